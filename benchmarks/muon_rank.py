"""One rank of the Muon benchmark: every variant on the same matrices, timed two ways:
``opt`` (``optimizer.step()`` on gradients drawn alike for every variant) and ``whole``
(forward + backward + ``optimizer.step()`` on a small data-parallel batch, so that the
all-gathers and reduce-scatters of each variant's storage layout are counted too)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flexshard as fs
from flexshard.optim import DistMuon, muon_buckets
from flexshard.runtime.bucket import slot_of
from flexshard.runtime.dtensor.region_dtensor import wrap
from flexshard.testing.stats import alternating, centred

from .muon_gather import GatherMuon

DIM = 128  # 512 on hosts with fast bf16 GEMMs (AVX-512 BF16 / AMX): Newton–Schulz is bf16


def shapes(dim: int = DIM) -> list[tuple[int, int]]:
    """Newton–Schulz-dominated: 8 square and 8 rectangular matrices; at W = 2 and 4 LPT
    gives every rank the same work (the 8 squares first, two or four each, then the rest)."""
    half = dim // 2
    return [(dim, dim)] * 8 + [(dim, half)] * 4 + [(half, dim)] * 4


#: DeepSeek-V3 (671B) matrices, [rows, cols] as nn.Linear stores them, each whole matrix
#: Muon sees: MLA's projections (kv_a_proj_with_mqa split into its latent and RoPE-key
#: rows, kv_b_proj into its key and value rows), the dense SwiGLU, and per MoE block the
#: router, the shared expert and each routed expert
DEEPSEEK_V3_HIDDEN = 7168
_MLA = [(1536, 7168), (128 * 192, 1536), (512, 7168), (64, 7168)]
_MLA += [(128 * 128, 512), (128 * 128, 512), (7168, 128 * 128)]
_DENSE = [(18432, 7168), (7168, 18432), (18432, 7168)]
_EXPERT = [(2048, 7168), (7168, 2048), (2048, 7168)]


def deepseek_v3_shapes(hidden: int, experts: int = 8) -> list[tuple[int, int]]:
    """One dense and two MoE blocks of DeepSeek-V3, every side scaled by
    ``hidden / 7168`` (the ratios of its shapes kept), ``experts`` routed experts (of
    256) per MoE block and a router for them."""
    scale = hidden / DEEPSEEK_V3_HIDDEN

    def scaled(shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(max(1, round(r * scale)), max(1, round(c * scale))) for r, c in shapes]

    router = (experts, hidden)  # one row per routed expert
    moe = scaled(_MLA) + [router] + scaled(_EXPERT * (1 + experts))  # shared + routed
    return scaled(_MLA + _DENSE) + 2 * moe


MODELS = ("square", "deepseek_v3")


def bank_shapes(model: str, dim: int) -> list[tuple[int, int]]:
    return deepseek_v3_shapes(dim) if model == "deepseek_v3" else shapes(dim)


BUCKETS = 4  # consecutive matrices per bucket: the redistribution pipelines over them
LR = 0.02
#: (a) is this project's own baseline (benchmarks/muon_gather.py, a DistMuon subclass
#: that all-gathers every matrix, as Moonlight's ZeRO-1 recipe does), not a third party's
VARIANTS = (
    "a GatherMuon (own gather-all baseline)",
    "b DistMuon Shard(0)",
    "c DistMuon Owned",
    "d AdamW",
)
MODES = ("opt", "whole")  # optimizer.step() alone; forward + backward + optimizer.step()
BATCH = 32  # rows of input per rank in the whole-step mode


class MatrixBank(nn.Module):
    def __init__(self, dim: int = DIM, model: str = "square") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.shapes = bank_shapes(model, dim)
        for i, shape in enumerate(self.shapes):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(shape, generator=gen)))

    def forward(self, inputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """Every matrix applied to the input of its width: a loss touching all of them."""
        loss = torch.zeros(())
        for i, (_, cols) in enumerate(self.shapes):
            loss = loss + (inputs[cols] @ getattr(self, f"w{i}").T).square().mean()
        return loss


def _buckets(placement: fs.Placement, count: int) -> list[fs.BucketSpec]:
    ends = [count * (b + 1) // BUCKETS for b in range(BUCKETS)]
    starts = [0, *ends[:-1]]
    return [
        fs.BucketSpec([f"w{i}" for i in range(start, end)], placement, name=f"b{b}")
        for b, (start, end) in enumerate(zip(starts, ends))
    ]


def _build(
    variant: str, mesh: DeviceMesh, dim: int, bank_model: str
) -> tuple[nn.Module, torch.optim.Optimizer]:
    if variant.startswith("c"):
        # the planner's buckets: whole matrices, owners by LPT on Newton–Schulz FLOPs
        buckets = muon_buckets(MatrixBank(dim, bank_model), mesh.size())
        model = fs.flex_shard(MatrixBank(dim, bank_model), mesh=mesh, buckets=buckets)
    else:
        bank = MatrixBank(dim, bank_model)
        model = fs.flex_shard(bank, mesh=mesh, buckets=_buckets(fs.Shard(0), len(bank.shapes)))
    params = list(model.parameters())
    if variant.startswith("a"):
        return model, GatherMuon(params, lr=LR)
    if variant.startswith("d"):
        return model, torch.optim.AdamW(params, lr=1e-3)
    return model, DistMuon(params, lr=LR)


def _grads(model: nn.Module, step: int) -> None:
    """Full gradients drawn alike on every rank; each keeps its local part, placed like
    the parameter (a DTensor over this rank's elements)."""
    gen = torch.Generator().manual_seed(100 + step)
    for name, param in model.named_parameters():
        full = torch.randn(model.shapes[int(name[1:])], generator=gen)
        bucket, index = slot_of(param)
        regions = bucket.layout.params[index].regions[bucket.store.rank]
        pieces = [r.view_of(full).reshape(-1) for r in regions]
        flat = torch.cat(pieces) if pieces else full.new_empty(0)
        param.grad = wrap(flat.view(bucket.local_tensor(index).shape), bucket.specs[index])


def _inputs(model: nn.Module, rank: int, step: int) -> dict[int, torch.Tensor]:
    """This rank's batch for one whole step (different on every rank, as data parallel)."""
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    widths = sorted({c for _, c in model.shapes})
    return {cols: torch.randn(BATCH, cols, generator=gen) for cols in widths}


def _count_collectives() -> tuple[dict[str, int], Callable[[], None]]:
    counts: dict[str, int] = {}
    saved = {}
    names = (
        "all_to_all_single",
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
    )
    for name in names:
        original = getattr(dist, name)
        saved[name] = original

        def counted(*args: Any, _name: str = name, _fn: Callable = original, **kw: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kw)

        setattr(dist, name, counted)

    def restore() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return counts, restore


def _step(mode: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    if mode == "opt":
        opt.step()
        return
    model(_inputs(model, rank, step)).backward()
    opt.step()
    opt.zero_grad()


def run_variant(
    variant: str, mode: str, mesh: DeviceMesh, steps: int, dim: int, bank_model: str
) -> dict:
    model, opt = _build(variant, mesh, dim, bank_model)
    rank = dist.get_rank()
    times, cpu, bytes_sent, collectives = [], [], [], []
    for step in range(steps + 2):  # two warm-up steps
        if mode == "opt":
            _grads(model, step)
        counts, restore = _count_collectives()
        stats_before = opt.comm_stats()["bytes_sent"] if hasattr(opt, "comm_stats") else 0
        model.comm_stats(reset=True)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        _step(mode, model, opt, rank, step)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        restore()
        if step >= 2:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            after = opt.comm_stats()["bytes_sent"] if hasattr(opt, "comm_stats") else 0
            moved = model.comm_stats()["total"]["bytes_sent"]  # the layout's gathers/reductions
            bytes_sent.append(after - stats_before + moved)
            collectives.append(sum(counts.values()))
    full = fs.full_state_dict(model)
    digest = hashlib.sha256(b"".join(full[k].numpy().tobytes() for k in sorted(full)))
    return {
        "ms": [t * 1e3 for t in times],
        "cpu_ms": [t * 1e3 for t in cpu],  # this process's CPU time (gloo threads too)
        "bytes_sent": bytes_sent[-1],
        "collectives": collectives[-1],
        "digest": digest.hexdigest()[:16],
    }


def rank_main(
    rank: int, world_size: int, steps: int, reps: int, dim: int = DIM, bank_model: str = "square"
) -> dict:
    """``out[mode][variant]``: one run per repetition, the variants' order reversed on
    every other repetition."""
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, dict[str, list]] = {m: {v: [] for v in VARIANTS} for m in MODES}
    for rep in range(reps):
        for mode in MODES:
            for variant in alternating(centred(VARIANTS, VARIANTS[0]), rep):
                run = run_variant(variant, mode, mesh, steps, dim, bank_model)
                out[mode][variant].append(run)
    return out
