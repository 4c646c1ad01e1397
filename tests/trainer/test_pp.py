"""Pipeline parallelism (flexshard/trainer/parallel/pipeline.py): GPipe, 1F1B and interleaved
1F1B stages, each sharded by flexshard over the data-parallel mesh, train like one
process on the global batch: losses, gradient norms and final parameters within fp32
tolerance; every bucket reduces its gradients exactly once per step; DistMuon on each
stage's parameters; layout errors before any collective."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import flexshard as fs
from flexshard.optim import DistMuon
from flexshard.runtime.bucket import slot_of
from flexshard.testing import run_distributed
from flexshard.trainer.config import ModelConfig
from flexshard.trainer.models.model import Transformer, init_module, init_weights
from flexshard.trainer.parallel.pipeline import build_pipeline, check_pipeline, init_stage_params
from flexshard.trainer.train import loss_fn

#: comm_stats entries that are no bucket (the unused-parameter agreement, the sum)
NOT_BUCKETS = ("total", "grad_agreement")

STEPS = 3
SEQ = 16
SEED = 5
# fp32: microbatch means and a sharded reduction sum in another order than one process
OUTER = ("tok_embeddings", "norm", "output")
TOL = {"rtol": 2e-5, "atol": 2e-6}
# AdamW divides by sqrt(v) + eps: a gradient element far below eps = 1e-8 would make
# its update ~lr * sign(g), so last-bit gradient differences could move it by up to lr;
# eps 1e-5 keeps such updates proportional to g (seen otherwise: 1.7e-5 with lr 3e-3)
ADAM_EPS = 1e-5
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-5}
EXACT = {"rtol": 0.0, "atol": 0.0}
NORM_ULP = {"rtol": 2.5e-7, "atol": 0.0}
MUON_TOL = {"rtol": 1e-3, "atol": 3e-3}  # measured: 7.4e-4 after 3 steps


def tiny_model_config(n_layers: int) -> ModelConfig:
    # dim 40 / ffn 34 rows: dp 2 and 3 do not divide every shape
    return ModelConfig(dim=40, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden=34)


def global_batches(dp: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        data = torch.randint(0, 256, (dp * batch, SEQ + 1), generator=gen)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def reference_run(cfg: ModelConfig, dp: int, batch: int, make_opt) -> tuple[list, list, dict]:
    """One process, the global batch in one piece."""
    model = Transformer(cfg)
    init_weights(model, SEED)
    optimizer = make_opt(model)
    losses, norms = [], []
    for tokens, labels in global_batches(dp, batch):
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


def shard_stage(dp_mesh, mp=None, reshard_after_forward=None):
    def shard(stage: nn.Module) -> nn.Module:
        specs = [fs.BucketSpec(f"layers.{i}.*", name=f"layers.{i}") for i in stage.layers.keys()]
        outer = [n for n in OUTER if next(getattr(stage, n).parameters(), None) is not None]
        if outer:
            specs.append(fs.BucketSpec([f"{n}.*" for n in outer], name="outer"))
        return fs.flex_shard(
            stage,
            mesh=dp_mesh,
            buckets=specs,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
        )

    return shard


def fsdp2_stage(dp_mesh, mp=None):
    """torch's own PP + FSDP2 recipe: fully_shard per block, then the stage root."""

    def shard(stage: nn.Module) -> nn.Module:
        for block in stage.layers:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp or MixedPrecisionPolicy())
        return fully_shard(stage, mesh=dp_mesh, mp_policy=mp or MixedPrecisionPolicy())

    return shard


def adamw(params_of):
    return lambda m: torch.optim.AdamW(params_of(m), lr=3e-3, weight_decay=0.1, eps=ADAM_EPS)


def pipeline_run(
    mesh,
    cfg,
    batch,
    schedule,
    n_micro,
    virtual,
    meta,
    make_opt,
    backend="flexshard",
    mp=None,
    reshard_after_forward=None,
) -> dict:
    dp_mesh, pp_mesh = mesh["dp_shard"], mesh["pp"]
    if backend == "flexshard":
        shard_fn = shard_stage(dp_mesh, mp, reshard_after_forward)
    else:
        shard_fn = fsdp2_stage(dp_mesh, mp)
    dtype = mp.param_dtype if mp is not None else torch.float32
    if meta:  # flexshard's way: no full copy anywhere, init stage by stage
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = Transformer(cfg)
        init_weights(model, SEED)
    runner = build_pipeline(
        model,
        pp_mesh,
        n_micro,
        schedule,
        loss_fn,
        shard_fn,
        virtual_stages=virtual,
        activation_dtype=dtype,
    )
    if meta:
        for module in runner.modules:
            module.to_empty(device="cpu")
        init_stage_params(runner.modules, SEED, init_module)
    optimizer = make_opt(runner)
    dp_rank = dp_mesh.get_local_rank()
    losses, norms, reduces, gathers = [], [], [], []
    for tokens, labels in global_batches(dp_mesh.size(), batch):
        rows = slice(dp_rank * batch, (dp_rank + 1) * batch)
        # the runner gives this dp rank's loss on every pp rank; the global batch's is
        # their mean (as the trainer logs it)
        loss = torch.tensor(runner.step(tokens[rows], labels[rows]))
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
        losses.append(float(loss))
        counts, gathered = {}, {}
        for module in runner.modules if backend == "flexshard" else ():
            stats = module.comm_stats(reset=True)
            buckets = {k: v for k, v in stats.items() if k not in NOT_BUCKETS}
            counts.update({k: v["reduce_scatter"] for k, v in buckets.items()})
            gathered.update({k: v["all_gather"] for k, v in buckets.items()})
        reduces.append(counts)
        gathers.append(gathered)
        stage = list(runner.parameters())
        norms.append(float(fs.clip_grad_norm_(stage, float("inf"), pp_group=runner.pp_group)))
        optimizer.step()
        optimizer.zero_grad()
    params = {}
    for module in runner.modules:
        if backend == "flexshard":
            params.update(fs.full_state_dict(module))
        else:
            params.update({k: v.full_tensor() for k, v in module.state_dict().items()})
    return {
        "losses": losses,
        "norms": norms,
        "reduces": reduces,
        "gathers": gathers,
        "params": params,
    }


def compare(got: dict, want: tuple, where: str, tol: dict = TOL, param_tol=PARAM_TOL) -> None:
    losses, norms, state = want
    close = functools.partial(torch.testing.assert_close, **tol)
    close_param = functools.partial(torch.testing.assert_close, **param_tol)
    close(torch.tensor(got["losses"]), torch.tensor(losses), msg=lambda m: f"{where}: {m}")
    close(torch.tensor(got["norms"]), torch.tensor(norms), msg=lambda m: f"{where}: {m}")
    assert got["params"], where
    for name, value in got["params"].items():
        close_param(value, state[name], msg=lambda m, name=name: f"{where}: {name}: {m}")
    # the measured gaps, shown by `pytest -s` (the report quotes them)
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], losses))
    norm_gap = max(abs(a - b) / abs(b) for a, b in zip(got["norms"], norms))
    param_gap = max(float((v - state[k]).abs().max()) for k, v in got["params"].items())
    print(
        f"{where}: loss rel {loss_gap:.1e}, grad norm rel {norm_gap:.1e}, param abs {param_gap:.1e}"
    )


def _layouts(rank: int, world: int, pp: int, batch: int, cases: list) -> list[str]:
    """Each case: schedule, microbatches, virtual stages, layers, meta init."""
    warnings.filterwarnings("ignore", message=".*is deprecated")
    dp = world // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp_shard"))
    done = []
    for schedule, n_micro, virtual, layers, meta in cases:
        cfg = tiny_model_config(layers)
        want = reference_run(cfg, dp, batch, adamw(lambda m: m.parameters()))
        got = pipeline_run(
            mesh, cfg, batch, schedule, n_micro, virtual, meta, adamw(lambda r: r.parameters())
        )
        where = f"{schedule} pp{pp} x dp{dp} rank {rank}"
        compare(got, want, where)
        # exactly one gradient reduction per bucket per step, whatever the microbatches
        # (none over a data-parallel group of one rank: a copy, as FSDP2)
        once = 1 if dp > 1 else 0
        stage_ids = [rank // dp + pp * v for v in range(virtual)]
        span = layers // (pp * virtual)
        expected = {f"layers.{i}" for s in stage_ids for i in range(s * span, (s + 1) * span)}
        for counts in got["reduces"]:
            assert {k for k in counts if k != "outer"} == expected, where
            assert set(counts.values()) == {once}, f"{where}: {counts}"
            assert ("outer" in counts) == (0 in stage_ids or pp * virtual - 1 in stage_ids)
        if pp == 2 and dp == 2:  # torch's PP + FSDP2 on the same layout: bit for bit
            peer = pipeline_run(
                mesh,
                cfg,
                batch,
                schedule,
                n_micro,
                virtual,
                False,
                adamw(lambda r: r.parameters()),
                "fsdp2",
            )
            # losses and parameters bit for bit; the norms sum in another order (1 ulp)
            assert got["losses"] == peer["losses"], f"{where} vs FSDP2"
            want = (peer["losses"], peer["norms"], peer["params"])
            compare(got, want, f"{where} vs FSDP2", NORM_ULP, EXACT)
        done.append(schedule)
    if pp == 3:
        done.append(_output_check_case(rank, world))
    if pp == 2 and dp == 2:
        done.append(_bf16_case(mesh, rank))
        done.append(_gather_once_case(mesh))
        done.append(_muon_case(mesh, rank))
        done.append(_error_cases(mesh))
    return done


def _gather_once_case(mesh) -> str:
    """Parameters kept gathered across microbatches (no reshard after forward; the stage
    reshards after backward only on the last): one all-gather per bucket per step, and
    the same losses bit for bit as resharding after every forward."""
    cfg = tiny_model_config(2)
    make_opt = adamw(lambda r: r.parameters())
    kept = pipeline_run(mesh, cfg, 4, "1f1b", 4, 1, False, make_opt, reshard_after_forward=False)
    freed = pipeline_run(mesh, cfg, 4, "1f1b", 4, 1, False, make_opt)
    assert kept["losses"] == freed["losses"]
    for counts in kept["gathers"]:
        assert counts and set(counts.values()) == {1}, counts
    for counts in freed["gathers"]:
        assert max(counts.values()) > 1, counts  # the blocks reshard after each forward
    return "one all-gather per step"


def _output_check_case(rank: int, world: int) -> str:
    """A stage whose output differs from the static metadata (here: activation_dtype
    bf16 for an fp32 model) raises, naming the stage, instead of sending bytes that the
    receiver would misread. One-stage pipelines on one-rank groups: nobody waits."""
    groups = [dist.new_group([r]) for r in range(world)]
    pp_mesh = DeviceMesh.from_group(groups[rank], "cpu", mesh_dim_names=("pp",))
    model = Transformer(tiny_model_config(1))
    runner = build_pipeline(model, pp_mesh, 1, "gpipe", loss_fn, activation_dtype=torch.bfloat16)
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match="pipeline stage 0: output torch.float32"):
        runner.step(tokens, tokens)
    return "output check"


def _bf16_case(mesh, rank: int) -> str:
    """bf16 compute, fp32 gradient reduction (bf16 hidden states between stages): 1F1B
    over flexshard stages bit for bit torch's PP + FSDP2 with the same policy."""
    cfg = tiny_model_config(4)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    opt = adamw(lambda r: r.parameters())
    got = pipeline_run(mesh, cfg, 4, "1f1b", 2, 1, False, opt, "flexshard", mp)
    peer = pipeline_run(mesh, cfg, 4, "1f1b", 2, 1, False, opt, "fsdp2", mp)
    where = f"bf16 1f1b pp2 x dp2 rank {rank} vs FSDP2"
    assert got["losses"] == peer["losses"], where
    compare(got, (peer["losses"], peer["norms"], peer["params"]), where, NORM_ULP, EXACT)
    return "bf16"


def _muon_case(mesh, rank: int) -> str:
    """DistMuon per stage (1F1B, pp2 x dp2): each stage's optimizer holds its own
    stage's matrices only. Bit for bit torch Muon on the same full gradients (a mirror
    of each matrix stepped by torch.optim.Muon every step); against the single process,
    torch Muon's bf16 Newton-Schulz turns the fp32 gradients' last-bit differences into
    differences of up to ~1e-3 after 3 steps, hence the looser MUON_TOL there."""
    cfg = tiny_model_config(2)
    dp_group = mesh["dp_shard"].get_group()

    def reference_opts(model: nn.Module):
        named = list(model.named_parameters())
        hidden = [p for n, p in named if _is_hidden_matrix(n, p.shape)]
        rest = [p for n, p in named if not _is_hidden_matrix(n, p.shape)]
        return _Both(
            torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3, eps=ADAM_EPS)
        )

    def stage_opts(runner):
        return _MirroredMuon(runner.modules, dp_group)

    want = reference_run(cfg, 2, 4, reference_opts)
    got = pipeline_run(mesh, cfg, 4, "1f1b", 2, 1, False, stage_opts)
    compare(got, want, f"DistMuon pp2 x dp2 rank {rank}", MUON_TOL, MUON_TOL)
    return "muon"


def _is_hidden_matrix(name: str, full_shape: torch.Size) -> bool:
    return name.startswith("layers.") and len(full_shape) == 2


def _full_shape(local: torch.Tensor) -> torch.Size:
    bucket, index = slot_of(local)
    return torch.Size(bucket.layout.params[index].shape)


def _full_grad(local: torch.Tensor, group) -> torch.Tensor:
    """The reduced gradient of a flexshard parameter, assembled from every rank's regions."""
    bucket, index = slot_of(local)
    layout = bucket.layout.params[index]
    pieces: list = [None] * dist.get_world_size(group)
    grad = local.grad.to_local().clone()  # a DTensor: its local piece travels
    dist.all_gather_object(pieces, (layout.regions[bucket.store.rank], grad), group=group)
    full = torch.zeros(layout.shape, dtype=local.dtype)
    for regions, grad in pieces:
        flat, start = grad.reshape(-1), 0
        for region in regions:
            box = region.view_of(full)
            box.copy_(flat[start : start + region.numel].view(box.shape))
            start += region.numel
    return full


class _Both:
    """Several optimizers stepped as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()


class _MirroredMuon(_Both):
    """One DistMuon and one AdamW per stage; each step also steps torch.optim.Muon on
    full mirrors of the stage's matrices with the gathered gradients, then checks that
    DistMuon's shards equal the mirrors bit for bit."""

    def __init__(self, modules: list[nn.Module], group) -> None:
        self.modules, self.group, self.pairs = modules, group, []
        opts = []
        for module in modules:
            named = list(module.named_parameters())
            hidden = [(n, p) for n, p in named if _is_hidden_matrix(n, _full_shape(p))]
            rest = [p for n, p in named if not _is_hidden_matrix(n, _full_shape(p))]
            full = fs.full_state_dict(module)
            mirrors = [nn.Parameter(full[n].clone()) for n, _ in hidden]
            self.pairs += [(n, p, m) for (n, p), m in zip(hidden, mirrors)]
            opts += [
                DistMuon([p for _, p in hidden], lr=0.02),
                torch.optim.AdamW(rest, lr=3e-3, eps=ADAM_EPS),
            ]
        self.torch_muon = torch.optim.Muon([m for _, _, m in self.pairs], lr=0.02)
        super().__init__(*opts)

    def step(self) -> None:
        for _, local, mirror in self.pairs:
            mirror.grad = _full_grad(local, self.group)
        super().step()
        self.torch_muon.step()
        self.torch_muon.zero_grad()
        full = {}
        for module in self.modules:
            full.update(fs.full_state_dict(module))
        for name, _, mirror in self.pairs:
            assert torch.equal(full[name], mirror.detach()), f"DistMuon != torch Muon: {name}"


def _error_cases(mesh) -> str:
    """Bad inputs raise ValueError before talking to anyone (the layouts themselves:
    ``check_pipeline``, run once before any rank starts)."""
    pp_mesh = mesh["pp"]
    runner = build_pipeline(Transformer(tiny_model_config(2)), pp_mesh, 2, "gpipe", loss_fn)
    tokens = torch.zeros(3, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match="not divisible by n_microbatches"):
        runner.step(tokens, tokens)
    with pytest.raises(ValueError, match="one shape"):
        runner.step(tokens[:2], tokens[:1])
    with pytest.raises(ValueError, match="sequence_shards = 3"):
        build_pipeline(
            Transformer(tiny_model_config(2)), pp_mesh, 2, "gpipe", loss_fn, sequence_shards=3
        ).step(tokens[:2], tokens[:2])
    with pytest.raises(TypeError, match="activation_dtype"):
        build_pipeline(
            Transformer(tiny_model_config(2)), pp_mesh, 2, "gpipe", loss_fn, activation_dtype="bf16"
        )
    return "errors"


def test_pipeline_layouts_match_single_process():
    """pp2 x dp2 (world 4): GPipe, 1F1B (meta-built, stage-wise init), interleaved 1F1B
    with two virtual stages per rank, DistMuon under PP, layout errors."""
    cases = [
        ("gpipe", 2, 1, 2, False),
        ("1f1b", 4, 1, 4, True),
        ("interleaved_1f1b", 2, 2, 4, False),
    ]
    results = run_distributed(_layouts, 4, 2, 4, cases, timeout=240)
    assert all(
        r
        == [
            "gpipe",
            "1f1b",
            "interleaved_1f1b",
            "bf16",
            "one all-gather per step",
            "muon",
            "errors",
        ]
        for r in results
    )


def test_pipeline_three_stages():
    """pp3 (odd): 1F1B over three stages and interleaved 1F1B over six (two per rank,
    so each rank's init skips the other ranks' stages in between), both meta-built;
    three microbatches of two sequences; flexshard on one-rank dp."""
    cases = [("1f1b", 3, 1, 3, True), ("interleaved_1f1b", 3, 2, 6, True)]
    results = run_distributed(_layouts, 3, 3, 6, cases, timeout=240)
    assert all(r == ["1f1b", "interleaved_1f1b", "output check"] for r in results)


@pytest.mark.parametrize(
    "n_layers, schedule, n_micro, virtual, message",
    [
        (3, "1f1b", 2, 1, "not divisible by pp"),
        (4, "gpipe", 2, 2, "needs schedule"),
        (4, "zb", 2, 1, "must be one of"),
        (4, "1f1b", 1, 1, "n_microbatches >= pp"),
        (4, "gpipe", 0, 1, "positive int"),
    ],
)
def test_check_pipeline_names_the_problem(n_layers, schedule, n_micro, virtual, message):
    with pytest.raises(ValueError, match=message):
        check_pipeline(n_layers, 2, virtual, schedule, n_micro)


def test_check_pipeline_interleaved_rounds():
    check_pipeline(8, 4, 2, "interleaved_1f1b", 8)  # 2 rounds of 4
    with pytest.raises(ValueError, match="multiple of its rounds"):
        check_pipeline(8, 4, 2, "interleaved_1f1b", 9)


def test_pipeline_over_three_dp_ranks():
    """pp2 x dp3 (world 6): flexshard shards each stage over three ranks, which divide
    none of dim 40, ffn 34 and kv rows 20 evenly."""
    results = run_distributed(_layouts, 6, 2, 2, [("1f1b", 2, 1, 2, False)], timeout=240)
    assert all(r == ["1f1b"] for r in results)
