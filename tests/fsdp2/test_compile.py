"""torch.compile as FSDP2 users use it: each block compiled after sharding. Dynamo's
graph breaks, graphs and frames are counted for torch FSDP2 and flexshard on the same
model and must match (0 breaks); compiled losses must equal eager ones bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.quant import MXFP8
from flexshard.testing import run_distributed

STEPS = 3
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(nn.Module):
    """Linear-GELU-Linear with a residual: a transformer block's MLP, user code (dynamo
    compiles its forward; torch.nn's own containers it would skip)."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, dim: int = 18, hidden: int = 17, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden, bias) for _ in range(3))
        self.norm = nn.LayerNorm(dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).float().square().mean()


def _block_or_shard(fqn: str, param: nn.Parameter) -> fs.Placement:
    return fs.BlockShard((8, 8)) if param.ndim == 2 else fs.Shard(0)


#: flex_shard buckets, one per block plus the root's norm, of every placement
PLACEMENTS = {
    "shard": fs.Shard(0),
    "flat": fs.FlatShard(),
    "owned": fs.Owned(),
    "block": _block_or_shard,
    "replicate": fs.Replicate(),
}


def _build(variant: str, mesh) -> Stack:
    """The same seeded model, sharded as ``variant`` says."""
    torch.manual_seed(0)
    if variant == "quant":  # 32 x 32 tiles: whole MXFP8 blocks, no 1-D parameters
        model = Stack(dim=32, hidden=64, bias=False)
        specs = [
            fs.BucketSpec(f"layers.{i}.*", fs.BlockShard((32, 32)), quant=MXFP8((32, 32)))
            for i in range(3)
        ]
        return fs.flex_shard(
            model, mesh=mesh, buckets=[*specs, fs.BucketSpec("norm.*", fs.Replicate())]
        )
    model = Stack()
    if variant in ("fsdp2", "fsdp2_bf16", "fully_shard", "fully_shard_bf16"):
        shard = torch_fully_shard if variant.startswith("fsdp2") else fs.fully_shard
        policy = BF16 if variant.endswith("bf16") else MixedPrecisionPolicy()
        for layer in model.layers:
            shard(layer, mesh=mesh, mp_policy=policy)
        return shard(model, mesh=mesh, mp_policy=policy)
    placement = PLACEMENTS[variant]
    specs = [fs.BucketSpec(f"layers.{i}.*", placement, name=f"layers.{i}") for i in range(3)]
    return fs.flex_shard(model, mesh=mesh, buckets=[*specs, fs.BucketSpec("norm.*", placement)])


def _train(model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    dim = model.norm.normalized_shape[0]
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(5, dim, generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _compiled(variant: str, whole: bool, backend: str, rank: int, mesh) -> dict:
    """Train ``variant`` with each block compiled (or the whole model); dynamo's counts."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _build(variant, mesh)
    if whole:
        model = torch.compile(model, backend=backend)
    else:
        for layer in model.layers:
            layer.compile(backend=backend)
    losses = _train(model, rank)
    frames = counters["frames"]
    return {
        "backend": backend,
        "losses": losses,
        "breaks": sum(counters["graph_break"].values()),
        "break_reasons": sorted(reason.splitlines()[0] for reason in counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],
        "calls_captured": counters["stats"]["calls_captured"],
        "frames": frames["total"],
        "frames_skipped": frames["total"] - frames["ok"],
    }


def _compare(rank: int, world_size: int, variants: list[str], whole: bool, backend: str) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for variant in variants:
        eager = _train(_build(variant, mesh), rank)
        out[variant] = {"eager": eager, **_compiled(variant, whole, backend, rank, mesh)}
    return out


def _check(results: list[dict], reference: str, variants: list[str]) -> None:
    for rank, runs in enumerate(results):
        ref = runs[reference]
        for variant in variants:
            run = runs[variant]
            where = f"rank {rank}, {variant}"
            if run["backend"] == "inductor":  # fused kernels round differently: FSDP2's bits
                assert run["losses"] == ref["losses"], f"{where}: differs from FSDP2 compiled"
                assert run["losses"] == pytest.approx(run["eager"], rel=1e-5), where
            else:  # aot_eager runs eager's kernels from the graph: eager's bits
                assert run["losses"] == run["eager"], f"{where}: compiled differs from eager"
            assert run["breaks"] == ref["breaks"] == 0, f"{where}: {run['break_reasons']}"
            # the blocks' own computation, once per distinct graph, nothing of flexshard's
            assert run["graphs"] == ref["graphs"] > 0, where
            assert run["calls_captured"] == ref["calls_captured"], where
            assert run["frames"] <= ref["frames"], where


def test_compiled_blocks_fully_shard_match_fsdp2():
    """FSDP2's own usage: ``block.compile()`` after ``fully_shard`` (fp32 and bf16)."""
    variants = ["fsdp2", "fully_shard", "fsdp2_bf16", "fully_shard_bf16"]
    results = run_distributed(_compare, 2, variants, False, "aot_eager")
    _check(results, "fsdp2", ["fully_shard"])
    _check(results, "fsdp2_bf16", ["fully_shard_bf16"])
    for rank, runs in enumerate(results):  # the same numbers as FSDP2, compiled or not
        assert runs["fully_shard"]["losses"] == runs["fsdp2"]["losses"], f"rank {rank}"


@pytest.mark.slow
def test_compiled_blocks_every_placement_and_quantized():
    variants = ["fsdp2", *PLACEMENTS, "quant"]
    results = run_distributed(_compare, 2, variants, False, "aot_eager")
    _check(results, "fsdp2", list(PLACEMENTS))
    for rank, runs in enumerate(results):  # another model: FSDP2's count of breaks (0)
        quant = runs["quant"]
        assert quant["losses"] == quant["eager"], f"rank {rank}"
        assert quant["breaks"] == 0 and quant["graphs"] > 0, quant["break_reasons"]


@pytest.mark.slow
def test_compiled_blocks_inductor_match_fsdp2():
    """The default backend: the same graphs as FSDP2's, so the same kernels and losses
    (bit for bit; against eager within fp32 rounding, for FSDP2 alike)."""
    results = run_distributed(_compare, 2, ["fsdp2", "fully_shard"], False, "inductor")
    _check(results, "fsdp2", ["fully_shard"])


@pytest.mark.slow
def test_whole_model_compile_breaks_as_fsdp2():
    """``torch.compile(model)``: dynamo inlines the blocks' calls, meets the sharding
    hooks (kept eager) and gives up on the root's loop for both implementations; each
    block's forward is then compiled on its own."""
    results = run_distributed(_compare, 2, ["fsdp2", "fully_shard"], True, "aot_eager")
    for rank, runs in enumerate(results):
        ref, ours = runs["fsdp2"], runs["fully_shard"]
        assert ours["losses"] == ours["eager"] == ref["losses"], f"rank {rank}"
        for key in ("breaks", "graphs", "calls_captured", "frames_skipped"):
            assert ours[key] == ref[key], f"rank {rank}: {key} {ours[key]} vs {ref[key]}"


def _trainer_runs(rank: int, world_size: int, folder: str, cases: dict[str, dict]) -> dict:
    """The trainer's losses with ``[compile]`` on and off, and dynamo's counts."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from flexshard.trainer.train import run

    from ..helpers.trainer_cases import tiny_config

    out = {}
    for name, extra in cases.items():
        torch._dynamo.reset()
        counters.clear()
        records = run(tiny_config(f"{folder}/{name}", training={"steps": 4}, **extra))
        out[name] = {
            "losses": [r["loss"] for r in records],
            "breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
        }
    return out


@pytest.mark.slow
def test_trainer_compile_under_tp(tmp_path):
    """``[compile] enable = true`` (per block, fullgraph) under the trainer's dp x tp
    composition: no break, FSDP2's graphs and FSDP2's losses bit for bit. Under tp,
    compiled DTensor blocks do not reproduce eager's losses in torch 2.13 (FSDP2 alike,
    and a tp-only model fails in DTensor's redistribute backward), so eager's bits are
    asserted for data parallelism alone."""
    on = {"enable": True, "backend": "aot_eager"}
    cases = {
        "eager": {"parallelism": {"tp": 2}},
        "compiled": {"parallelism": {"tp": 2}, "compile": on},
        "fsdp2_compiled": {"parallelism": {"tp": 2, "dp_backend": "fsdp2"}, "compile": on},
        "dp_compiled": {"compile": on},
        "dp_eager": {},
    }
    results = run_distributed(_trainer_runs, 4, str(tmp_path), cases, timeout=900)
    for rank, runs in enumerate(results):
        assert runs["compiled"]["losses"] == runs["fsdp2_compiled"]["losses"], rank
        assert runs["compiled"]["losses"] == pytest.approx(runs["eager"]["losses"], rel=5e-3)
        assert runs["dp_compiled"]["losses"] == runs["dp_eager"]["losses"], rank
        for name in ("compiled", "fsdp2_compiled", "dp_compiled"):
            assert runs[name]["breaks"] == 0 and runs[name]["graphs"] > 0, (rank, name)
        assert runs["compiled"]["graphs"] == runs["fsdp2_compiled"]["graphs"], rank
