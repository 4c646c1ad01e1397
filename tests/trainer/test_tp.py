"""Tensor parallelism (torch DTensor ``parallelize_module``) composed with flexshard.

flexshard shards each TP DTensor's local tensor over the dp group and gives the modules
DTensors back after unshard. Against one process on the same global batch and initial
weights: losses, gradient norms and final parameters after a few AdamW steps, for tp2
alone and dp2 x tp2 with Shard(0), BlockShard and Owned (MoE) buckets; full state dicts
and DCP checkpoints across layouts; a quantized (MXFP8 32x32) bucket on TP-local tiles.

Tolerance: row-parallel projections sum their partial products over tp in another
order than one process does, so values agree to fp32 rounding (rtol 1e-5 on losses
and norms, atol 2e-5 on parameters after the steps), not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial

import flexshard as fs
from flexshard.checkpoint import load as ckpt_load
from flexshard.checkpoint import save as ckpt_save
from flexshard.optim import DistMuon
from flexshard.quant import MXFP8, dequantize, quantize
from flexshard.testing import run_distributed
from flexshard.trainer.config import ConfigError
from flexshard.trainer.models.model import Transformer, init_module
from flexshard.trainer.parallel.tensor_parallel import apply_tp, check_tp
from tests.helpers import tp_cases as tc

STEPS = 4


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fs.full_state_dict(model).items()}


def _portable(params: dict[str, torch.Tensor]) -> dict:
    """Tensors travel back from the spawned ranks by value (numpy), not shared memory."""
    return {k: v.numpy() for k, v in params.items()}


def _tensors(params: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in params.items()}


def _layouts_case(rank: int, world: int, root: str) -> dict:
    """dp2 x tp2: three placements, the MoE model under TP, then a DCP save."""
    mesh = tc.tp_mesh(2, 2)
    out: dict = {}
    for name, placement, moe in [
        ("shard0", fs.Shard(0), False),
        ("block", tc.block_or_shard, False),
        ("owned-moe", tc.owned_or_flat, True),
    ]:
        model = tc.build(tc.model_config(moe=moe), mesh, placement)
        # sharded parameters are DTensors on the (dp, tp) mesh, as FSDP2 + TP makes them
        local = model.layers[0].attention.wq.weight
        assert isinstance(local, DTensor) and local.device_mesh.ndim == 2, type(local)
        losses, norms = tc.train(model, mesh, STEPS)
        out[name] = (losses, norms, _portable(_full_params(model)))
        if name == "shard0":
            ckpt_save(f"{root}/ckpt", model)
    # bf16 gathers: the DTensors the modules get carry the cast dtype
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = tc.build(tc.model_config(), mesh, fs.Shard(0), mp_policy=policy)
    out["bf16"] = tc.train(model, mesh, 2)[0]
    out["quant"] = _quant_case(mesh)
    out["trainer-muon"] = tc.trainer_muon(mesh, 3)
    out["muon"] = _muon_case(mesh)
    return out


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory) -> tuple[list[dict], str]:
    """Every dp2 x tp2 sub-case in one spawn of 4 ranks (start-up is the cost)."""
    root = str(tmp_path_factory.mktemp("dp2_tp2"))
    return run_distributed(_layouts_case, 4, root, timeout=300), root


def test_dp2_tp2_matches_single_process(dp2_tp2) -> None:
    results, root = dp2_tp2
    for name, moe in [("shard0", False), ("block", False), ("owned-moe", True)]:
        ref_losses, ref_norms, ref_params = tc.reference(tc.model_config(moe=moe), 2, STEPS)
        for rank, result in enumerate(results):
            losses, norms, params = result[name][:2] + (_tensors(result[name][2]),)
            where = f"{name}, rank {rank}"
            assert losses == pytest.approx(ref_losses, rel=1e-5), where
            assert norms == pytest.approx(ref_norms, rel=1e-5), where
            assert params.keys() == ref_params.keys()
            for key, value in params.items():
                torch.testing.assert_close(value, ref_params[key], rtol=0, atol=2e-5, msg=where)
    # bf16 compute: within bf16 rounding of the fp32 run
    ref_bf16 = tc.reference(tc.model_config(), 2, 2)[0]
    for result in results:
        assert result["bf16"] == pytest.approx(ref_bf16, rel=2e-3)
        assert result["bf16"] != ref_bf16
    # the DCP checkpoint saved under dp2 x tp2 loads into one unsharded process
    model = Transformer(tc.model_config())
    ckpt_load(f"{root}/ckpt", model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, _tensors(results[0]["shard0"][2])[key]), key


def _tp_alone_case(rank: int, world: int, root: str) -> dict:
    """tp2 alone (a dp group of one), then the dp2 x tp2 checkpoint resumed on tp2."""
    mesh = tc.tp_mesh(1, 2)
    model = tc.build(tc.model_config(), mesh, fs.Shard(0))
    opt = torch.optim.AdamW(model.parameters(), lr=tc.LR, weight_decay=0.1)
    losses, norms = tc.train(model, mesh, STEPS, opt)
    trained = _full_params(model)
    # model and AdamW state saved on Shard(0), resumed on Owned: the next step agrees
    ckpt_save(f"{root}/with_optim", model, opt)
    other = tc.build(tc.model_config(), mesh, tc.owned_or_flat)
    other_opt = torch.optim.AdamW(other.parameters(), lr=tc.LR, weight_decay=0.1)
    ckpt_load(f"{root}/with_optim", other, other_opt)
    tc.train(model, mesh, 1, opt)
    tc.train(other, mesh, 1, other_opt)
    next_step = [_full_params(m) for m in (model, other)]
    assert all(torch.equal(v, next_step[1][k]) for k, v in next_step[0].items())
    # load_full_state_dict takes whole tensors: each tp rank keeps its piece
    fresh = tc.build(tc.model_config(), mesh, tc.owned_or_flat)
    fs.load_full_state_dict(fresh, trained)
    reloaded = _full_params(fresh)
    resumed = tc.build(tc.model_config(), mesh, tc.block_or_shard)
    ckpt_load(f"{root}/ckpt", resumed)
    # the trainer's path: built on meta, TP, flexshard, then initialised module by module
    with torch.device("meta"):
        meta = Transformer(tc.model_config())
    apply_tp(meta, mesh["tp"])
    meta = fs.flex_shard(meta, mesh=mesh["dp_shard"], buckets=[fs.BucketSpec("*", fs.Shard(0))])
    meta.to_empty(device="cpu")
    torch.manual_seed(tc.SEED)
    fs.init_params(meta, init_module)
    # a DTensor that is not TP's (a Partial sum) is refused before any collective
    partial = nn.Linear(4, 4, bias=False)
    partial.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    with pytest.raises(ValueError, match="bucket 'p': parameter 'weight' is a DTensor with"):
        fs.flex_shard(partial, mesh=mesh["dp_shard"], buckets=[fs.BucketSpec("*", name="p")])
    # without sequence parallelism (norms replicated, activations whole between parts)
    plain_tp = tc.build(tc.model_config(moe=True), mesh, fs.Shard(0), sequence_parallel=False)
    return {
        "no-sp": tc.train(plain_tp, mesh, 2),
        "meta-init": _portable(_full_params(meta)),
        "train": (losses, norms, _portable(trained)),
        "reloaded": _portable(reloaded),
        "resumed": _portable(_full_params(resumed)),
    }


def test_tp2_alone_and_state_dicts(tmp_path) -> None:
    # a checkpoint saved by one process, loaded under tp2 with BlockShard buckets
    cfg = tc.model_config()
    _, _, saved = tc.reference(cfg, 1, 1)
    source = Transformer(cfg)
    source.load_state_dict(saved)
    ckpt_save(tmp_path / "ckpt", source)
    results = run_distributed(_tp_alone_case, 2, str(tmp_path), timeout=120)
    ref_losses, ref_norms, ref_params = tc.reference(cfg, 1, STEPS)
    for rank, result in enumerate(results):
        losses, norms, params = result["train"][:2] + (_tensors(result["train"][2]),)
        assert losses == pytest.approx(ref_losses, rel=1e-5), rank
        assert norms == pytest.approx(ref_norms, rel=1e-5), rank
        for key, value in params.items():
            torch.testing.assert_close(value, ref_params[key], rtol=0, atol=2e-5)
            assert torch.equal(_tensors(result["reloaded"])[key], value), key
        for key, value in _tensors(result["resumed"]).items():
            assert torch.equal(value, saved[key]), key
        no_sp_losses, no_sp_norms, _ = tc.reference(tc.model_config(moe=True), 1, 2)
        assert result["no-sp"][0] == pytest.approx(no_sp_losses, rel=1e-5)
        assert result["no-sp"][1] == pytest.approx(no_sp_norms, rel=1e-5)
        initial = Transformer(cfg)
        tc.init_weights(initial, tc.SEED)
        for key, value in _tensors(result["meta-init"]).items():
            assert torch.equal(value, initial.state_dict()[key]), key


QUANT = MXFP8((32, 32))
QUANT_PATTERNS = ["layers.*.attention.wq.weight", "layers.*.attention.wo.weight"]
QUANT_REST = [
    *tc.OUTER,
    "layers.*.attention.wk.*",
    "layers.*.attention.wv.*",
    "layers.*_norm.*",
    "layers.*.feed_forward.*",
]


def _qdq_tp_pieces(full: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    """What a quantized bucket under TP gathers: each tp piece quantized on its own tiles."""
    pieces = [dequantize(quantize(p, QUANT), full.dtype) for p in full.chunk(tp, dim)]
    return torch.cat(pieces, dim)


def _quant_case(mesh: DeviceMesh) -> list[float]:
    """dp2 x tp2; the attention's wq (column) and wo (row) in one MXFP8 bucket."""
    cfg = tc.model_config(dim=64)
    model = Transformer(cfg)
    tc.init_weights(model, tc.SEED)
    apply_tp(model, mesh["tp"])
    specs = [
        fs.BucketSpec(QUANT_PATTERNS, fs.BlockShard((32, 32)), name="quant", quant=QUANT),
        fs.BucketSpec(QUANT_REST, fs.Shard(0), name="rest"),
    ]
    model = fs.flex_shard(model, mesh=mesh["dp_shard"], buckets=specs)
    losses, _ = tc.train(model, mesh, 2)
    return losses


def _quant_reference(steps: int) -> list[float]:
    """One process: the master weights train, the forward uses their TP-piecewise QDQ."""

    def qdq(model: Transformer) -> None:
        for layer in model.layers:
            wq, wo = layer.attention.wq.weight, layer.attention.wo.weight
            wq.copy_(_qdq_tp_pieces(wq, 0, 2))  # column-parallel: split by rows
            wo.copy_(_qdq_tp_pieces(wo, 1, 2))  # row-parallel: split by columns

    return tc.quantized_reference(tc.model_config(dim=64), 2, steps, qdq)


def test_quantized_bucket_under_tp(dp2_tp2) -> None:
    results = [r["quant"] for r in dp2_tp2[0]]
    expected = _quant_reference(2)
    unquantized = tc.reference(tc.model_config(dim=64), 2, 1)[0][0]
    assert expected[0] != unquantized  # the quantization shows in the loss
    for losses in results:
        assert losses == pytest.approx(expected, rel=1e-5)


def test_trainer_muon_recipe_under_tp(dp2_tp2) -> None:
    """Newton–Schulz runs in bf16, so fp32 rounding differences in the TP gradients can
    flip bf16 roundings: the losses agree to 1e-5 relative over 3 steps, not bit for bit."""
    expected = tc.trainer_muon(None, 3)
    for result in dp2_tp2[0]:
        assert result["trainer-muon"] == pytest.approx(expected, rel=1e-5)


def test_heads_not_divisible_by_tp() -> None:
    with pytest.raises(ConfigError, match="n_heads = 4 is not divisible by parallelism.tp = 3"):
        check_tp(tc.model_config(), 3)
    with pytest.raises(ConfigError, match="n_kv_heads = 2 is not divisible by parallelism.tp = 4"):
        check_tp(tc.model_config(), 4)
    check_tp(tc.model_config(), 2)


MUON_KEYS = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight")


def _muon_names(model: nn.Module) -> list[str]:
    """Column-parallel (Shard(0) over tp), row-parallel (Shard(1)) and the output head
    (61 vocabulary rows: 31 / 30 over tp, then 16 / 15 over dp)."""
    names = [n for n, _ in model.named_parameters() if n.endswith(MUON_KEYS)]
    return [*names, "output.weight"]


def _seeded_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


HEAD_ROWS = {"wq.weight", "wk.weight", "wv.weight"}  # per-head Muon: 8 rows per block


def _muon_groups(params: dict[str, torch.Tensor], names: list[str], heads: bool) -> list[dict]:
    if not heads:
        return [{"params": [params[n] for n in names]}]
    per_head = [n for n in names if n.rsplit(".", 2)[-2] + ".weight" in HEAD_ROWS]
    rest = [n for n in names if n not in per_head]
    return [
        {"params": [params[n] for n in per_head], "row_blocks": 8},
        {"params": [params[n] for n in rest]},
    ]


def _muon_case(mesh: DeviceMesh) -> dict:
    """dp2 x tp2 DistMuon with gradients set from seeded whole matrices: each rank
    slices its piece (torch.chunk over tp, as DTensor's Shard; then Shard(0) rows
    over dp), steps, and returns the gathered parameters. With ``heads`` (4 kv heads:
    every projection piece is whole heads, 8 rows each) q/k/v run per-head Muon on
    the piece, the other matrices are gathered whole."""
    out = {}
    for heads in (False, True):
        cfg = tc.model_config(n_kv_heads=4 if heads else 2)
        names = _muon_names(Transformer(cfg))
        model = tc.build(cfg, mesh, fs.Shard(0))
        params = dict(model.named_parameters())
        opt = DistMuon(_muon_groups(params, names, heads), lr=0.02, weight_decay=0.1)
        tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp_shard")
        for step in range(2):
            grads = _seeded_grads(Transformer(cfg).to("meta"), step)
            for name in names:
                dim = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
                rows = grads[name].chunk(2, dim)[tp_rank].chunk(2, 0)
                local = params[name]  # a DTensor: the gradient is one of its local pieces
                shape = local.to_local().shape
                piece = rows[dp_rank].reshape(shape) if dp_rank < len(rows) else torch.zeros(shape)
                local.grad = DTensor.from_local(
                    piece,
                    local.device_mesh,
                    local.placements,
                    shape=local.shape,
                    stride=local.stride(),
                    run_check=False,
                )
            opt.step()
        full = _full_params(model)
        out[heads] = _portable({n: full[n] for n in names})
    return out


def test_dist_muon_under_tp_matches_torch_muon(dp2_tp2) -> None:
    """Whole matrices: torch.optim.Muon; per-head blocks: DistMuon on plain tensors
    (itself bit for bit torch Muon per block, tests/optim/test_dist_muon.py)."""
    for heads in (False, True):
        cfg = tc.model_config(n_kv_heads=4 if heads else 2)
        model = Transformer(cfg)
        tc.init_weights(model, tc.SEED)
        names = _muon_names(model)
        params = dict(model.named_parameters())
        groups = _muon_groups(params, names, heads)
        opt = (
            DistMuon(groups, lr=0.02, weight_decay=0.1)
            if heads
            else torch.optim.Muon(groups, lr=0.02, weight_decay=0.1)
        )
        for step in range(2):
            grads = _seeded_grads(model, step)
            for name in names:
                params[name].grad = grads[name]
            opt.step()
        for rank, result in enumerate(dp2_tp2[0]):
            got = _tensors(result["muon"][heads])
            for name in names:  # bit for bit: the same Newton–Schulz on the same matrices
                assert torch.equal(got[name], params[name].detach()), (heads, rank, name)
