"""The prepared one-shot GPU check: run by benchmarks/gpu_check.sh on a machine
with one or more CUDA GPUs; writes gpu_check.json and gpu_check.md to OUT.

    benchmarks/gpu_check.sh OUT [NPROC]                      # W = 1, then torchrun W = NPROC
    .venv/bin/python -m benchmarks.gpu_check OUT              # one process, CUDA + NCCL
    torchrun --standalone --nproc-per-node N -m benchmarks.gpu_check OUT
    .venv/bin/python -m benchmarks.gpu_check OUT --dry-run    # CPU + gloo, tiny, seconds

Checks, each reported ok / failed with its figures (one failing does not stop the rest):

* ``parity_fp32``, ``parity_bf16``: flexshard's ``fully_shard`` against torch FSDP2 on a
  Llama-style block stack, same seed and batches: losses and final parameters bit for bit;
* ``speed``: step time (median) and peak memory against FSDP2, bf16 parameters, a larger
  stack, the order of the two alternated over repetitions;
* ``trace``: a profiler trace of flexshard steps (saved to OUT): flexshard's spans for
  every bucket, the streams NCCL kernels ran on, and how much of their time overlapped
  compute kernels;
* ``quantized_gather``: FP8 blockwise and MXFP8 BlockShard buckets gathered on the device
  equal the CPU codec's dequantize(quantize(x)) bit for bit, free their fp8 codes once
  decoded, peak under (1.5 + 1/W)x the weights while unsharding, and train a few steps;
* ``dist_muon``: DistMuon on flex_shard parameters against torch.optim.Muon on a replica;
* ``unused_grads``: a parameter no rank used keeps ``.grad`` None, one used on rank 0
  only gets a gradient everywhere (the agreement on the device, W > 1).

``--dry-run`` runs the same code on CPU/gloo with tiny shapes (a fast test runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

import flexshard as fs
from flexshard.quant import MXFP8, FP8Blockwise, dequantize, quantize
from flexshard.runtime.module import own_buckets
from flexshard.trainer.config import ModelConfig
from flexshard.trainer.launch import free_port
from flexshard.trainer.models.model import Transformer, init_weights

from .common import write_results


@dataclass
class Ctx:
    device: torch.device
    mesh: DeviceMesh
    rank: int
    world: int
    dry_run: bool
    out: Path

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream now (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def _config(ctx: Ctx, big: bool) -> ModelConfig:
    if ctx.dry_run:
        return ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    if big:  # ~0.5 B parameters: Llama-3-style 2048-wide blocks
        return ModelConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8)
    # many small blocks: the runtime's CPU work per bucket, not compute, sets the pace
    return ModelConfig(vocab_size=512, dim=256, n_layers=16, n_heads=8, n_kv_heads=4)


def _batches(ctx: Ctx, cfg: ModelConfig, steps: int, big: bool) -> list[tuple[torch.Tensor, ...]]:
    """Per step this rank's (tokens, targets); every rank draws all and keeps its own."""
    batch, seq = (2, 16) if ctx.dry_run else ((4, 2048) if big else (4, 256))
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (ctx.world, batch, seq + 1), generator=gen)
        mine = tokens[ctx.rank].to(ctx.device)
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def _model(ctx: Ctx, cfg: ModelConfig, shard: Callable, policy: MixedPrecisionPolicy):
    with ctx.device:  # built and initialised on the device: seconds, not minutes
        model = Transformer(cfg)
        init_weights(model, seed=0)
    for layer in model.layers:
        shard(layer, mesh=ctx.mesh, mp_policy=policy)
    shard(model, mesh=ctx.mesh, mp_policy=policy)
    return model


def _step(model, opt, tokens, targets) -> torch.Tensor:
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _full_state(model) -> dict[str, torch.Tensor]:
    if isinstance(model, fs.FlexShardModule):
        return fs.full_state_dict(model)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def parity(ctx: Ctx, dtype: torch.dtype) -> dict[str, Any]:
    cfg = _config(ctx, big=False)
    policy = MixedPrecisionPolicy(
        param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
    )
    steps = 2 if ctx.dry_run else 5
    batches = _batches(ctx, cfg, steps, big=False)
    results = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard)):
        model = _model(ctx, cfg, shard, policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        # the math attention kernel: fused ones may accumulate in a varying order
        with sdpa_kernel(SDPBackend.MATH):
            losses = [_step(model, opt, *batch).item() for batch in batches]
        results[name] = (losses, _full_state(model))
    (ref_losses, ref_state), (our_losses, our_state) = results["fsdp2"], results["flexshard"]
    differ = [k for k in ref_state if not torch.equal(ref_state[k], our_state[k])]
    return {
        "ok": ref_losses == our_losses and not differ,
        "losses_fsdp2": ref_losses,
        "losses_flexshard": our_losses,
        "params_differing": differ,
    }


def _time_steps(ctx: Ctx, shard: Callable, steps: int, warmup: int, big: bool) -> dict[str, Any]:
    """Per step (medians): wall time with the device synchronised, the host's time to
    issue the step (wall and this thread's CPU time, before any synchronisation) and
    the device's time between events around it. Issue time under device time: the CPU
    keeps the kernels fed."""
    cfg = _config(ctx, big=big)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model(ctx, cfg, shard, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.device.type == "cuda")
    batches = _batches(ctx, cfg, warmup + steps, big=big)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    figures: dict[str, list[float]] = {"step_s": [], "issue_s": [], "cpu_s": [], "gpu_s": []}
    for i, batch in enumerate(batches):
        ctx.sync()
        start, start_cpu, begin = time.perf_counter(), time.thread_time(), ctx.event()
        _step(model, opt, *batch)
        issued, cpu, end = time.perf_counter() - start, time.thread_time() - start_cpu, ctx.event()
        ctx.sync()
        wall = time.perf_counter() - start
        if i >= warmup:
            figures["step_s"].append(wall)
            figures["issue_s"].append(issued)
            figures["cpu_s"].append(cpu)
            figures["gpu_s"].append(begin.elapsed_time(end) / 1e3 if begin else wall)
    peak = torch.cuda.max_memory_allocated() if ctx.device.type == "cuda" else 0
    del model, opt
    gc.collect()
    return {**{k: statistics.median(v) for k, v in figures.items()}, "peak_bytes": peak}


def speed(ctx: Ctx) -> dict[str, Any]:
    """FSDP2 vs flexshard on ~0.5 B wide blocks ("big") and on many small blocks
    ("small", where the runtime's CPU work per bucket shows): step, issue, CPU and
    GPU time per step, peak memory."""
    steps, warmup, reps = (2, 1, 2) if ctx.dry_run else (8, 3, 3)
    out: dict[str, Any] = {"ok": True}  # figures, not a verdict: the README quotes them
    for model_size, big in (("big", True), ("small", False)):
        runs: dict[str, list[dict[str, float]]] = {"fsdp2": [], "flexshard": []}
        for rep in range(reps):
            order = ["fsdp2", "flexshard"] if rep % 2 == 0 else ["flexshard", "fsdp2"]
            for name in order:
                shard = torch_fully_shard if name == "fsdp2" else fs.fully_shard
                runs[name].append(_time_steps(ctx, shard, steps, warmup, big))
        times = {
            kind: {k: statistics.median(r[kind] for r in v) for k, v in runs.items()}
            for kind in ("step_s", "issue_s", "cpu_s", "gpu_s")
        }
        peak = {k: max(r["peak_bytes"] for r in v) for k, v in runs.items()}
        out[model_size] = {
            **times,
            "peak_gib": {k: v / 2**30 for k, v in peak.items()},
            "step_ratio": times["step_s"]["flexshard"] / times["step_s"]["fsdp2"],
            "cpu_ratio": times["cpu_s"]["flexshard"] / times["cpu_s"]["fsdp2"],
            "peak_ratio": peak["flexshard"] / peak["fsdp2"] if peak["fsdp2"] else None,
        }
    return out


def _overlap(kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the NCCL kernels' time, the share that ran while a compute kernel ran."""
    nccl = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" in k["name"].lower()]
    compute = sorted(
        (k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" not in k["name"].lower()
    )
    total = sum(end - start for start, end in nccl)
    covered = 0.0
    for start, end in nccl:
        for c_start, c_end in compute:
            if c_start >= end:
                break
            covered += max(0.0, min(end, c_end) - max(start, c_start))
    streams = sorted({k["args"].get("stream") for k in kernels if "nccl" in k["name"].lower()})
    return {
        "nccl_kernels": len(nccl),
        "nccl_us": total,
        "overlap_fraction": covered / total if total else None,
        "nccl_streams": streams,
    }


def trace(ctx: Ctx) -> dict[str, Any]:
    cfg = _config(ctx, big=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model(ctx, cfg, fs.fully_shard, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = _batches(ctx, cfg, 4, big=False)
    for batch in batches[:2]:  # the first step learns the prefetch order
        _step(model, opt, *batch)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for batch in batches[2:]:
            _step(model, opt, *batch)
        ctx.sync()
    path = ctx.out / f"trace_rank{ctx.rank}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    buckets = [f"layers.{i}" for i in range(cfg.n_layers)] + ["root"]
    kinds = ("all_gather", "all_gather_copy_out", "reduce_scatter", "grad_copy")
    missing = [f"flexshard::{k}[{b}]" for b in buckets for k in kinds]
    missing = [m for m in missing if m not in names]
    overlap = _overlap([e for e in events if e.get("cat") == "kernel"])
    # with several GPUs some NCCL time must hide behind compute; W = 1 has nothing to hide
    hidden = ctx.world == 1 or ctx.device.type != "cuda" or (overlap["overlap_fraction"] or 0) > 0
    return {"ok": not missing and hidden, "missing_spans": missing, "trace": path.name, **overlap}


def quantized_gather(ctx: Ctx) -> dict[str, Any]:
    from torch import nn

    side = 64 if ctx.dry_run else 1024
    block = 32 if ctx.dry_run else 128
    formats = {"fp8_blockwise": FP8Blockwise((block, block)), "mxfp8_1x32": MXFP8((1, 32))}
    out: dict[str, Any] = {"ok": True}
    for name, fmt in formats.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(side, 2 * side, bias=False), nn.Linear(2 * side, side))
        net.to(ctx.device)
        full = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        bucket = fs.BucketSpec(
            "*.weight", placement=fs.BlockShard((block, block)), name="w", quant=fmt
        )
        rest = fs.BucketSpec("*.bias", name="b")
        model = fs.flex_shard(net, mesh=ctx.mesh, buckets=[bucket, rest])
        memory = _unshard_memory(ctx, model)
        exact = all(
            torch.equal(
                model[int(k.split(".")[0])].weight.detach().cpu(),
                dequantize(quantize(full[k], fmt), dtype=full[k].dtype),
            )
            for k in full
            if k.endswith("weight")
        )
        model.reshard()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, side, device=ctx.device)
        losses = []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        finite = all(torch.isfinite(torch.tensor(losses)))
        out[name] = {"gathered_bitwise_cpu_codec": exact, "losses": losses, **memory}
        out["ok"] = out["ok"] and exact and finite and memory["memory_ok"]
    return out


def _unshard_memory(ctx: Ctx, model: Any) -> dict[str, Any]:
    """Unshard the quantized bucket "w": its fp8 codes are freed once decoded, and the
    unshard's peak (CUDA) stays under full weights + codes + the eager decode's float32
    pieces (block by block, at most 2^22 elements); a whole-bucket temporary adds 1.0."""
    (bucket,) = [b for b in own_buckets(model) if b.name == "w"]
    full_bytes = sum(math.prod(p.shape) * 4 for p in bucket.layout.params)  # fp32 weights
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model.unshard()
    freed = bucket.full.gathered.untyped_storage().size() == 0
    ratio = limit = None
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        ratio = (torch.cuda.max_memory_allocated() - base) / full_bytes
        limit = 1.5 + 1.0 / ctx.world  # full, codes + scales (~0.26), values, slack
    return {
        "codes_freed_after_decode": freed,
        "unshard_peak_over_full_weights": ratio,
        "unshard_peak_limit": limit,
        "memory_ok": freed and (ratio is None or ratio <= limit),
    }


def dist_muon(ctx: Ctx) -> dict[str, Any]:
    from torch import nn

    side = 48 if ctx.dry_run else 1024

    def net() -> nn.Module:
        return nn.Sequential(
            nn.Linear(side, side, bias=False), nn.Linear(side, 2 * side, bias=False)
        )

    torch.manual_seed(0)
    reference = net()
    reference.to(ctx.device)
    ours = net()
    ours.load_state_dict(reference.state_dict())
    ours.to(ctx.device)
    ours = fs.flex_shard(ours, mesh=ctx.mesh, buckets=[fs.BucketSpec("*", name="all")])
    ref_opt = torch.optim.Muon(reference.parameters(), lr=0.02)
    our_opt = fs.optim.DistMuon(ours.parameters(), lr=0.02)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(16, side, generator=gen).to(ctx.device)
        for model, opt in ((reference, ref_opt), (ours, our_opt)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    ref_state = reference.state_dict()
    our_state = fs.full_state_dict(ours)
    diff = max((ref_state[k] - our_state[k]).abs().max().item() for k in ref_state)
    equal = all(torch.equal(ref_state[k], our_state[k]) for k in ref_state)
    return {"ok": diff <= 1e-6, "bitwise": equal, "max_abs_diff": diff}


class _Heads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.b, self.c = (torch.nn.Linear(32, n) for n in (32, 8, 8))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = self.body(x)
        return h.square().mean() + (self.c(h).square().mean() if rank == 0 else 0)


def unused_grads(ctx: Ctx) -> dict[str, Any]:
    """Head b unused on every rank keeps ``.grad`` None; head c, run everywhere but used on
    rank 0 only, gets a gradient on every rank (the agreement's all-reduce on the device)."""
    torch.manual_seed(0)
    model = fs.flex_shard(
        _Heads().to(ctx.device), mesh=ctx.mesh, buckets=[fs.BucketSpec("*", name="all")]
    )
    model(torch.randn(4, 32, device=ctx.device), ctx.rank).backward()
    none = sorted(n for n, p in model.named_parameters() if p.grad is None)
    agreed = model.comm_stats()["grad_agreement"]["all_reduce"]
    ok = none == ["b.bias", "b.weight"] and agreed == (ctx.world > 1)
    return {"ok": ok, "grad_none": none, "agreement_all_reduces": agreed}


CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "parity_fp32": lambda ctx: parity(ctx, torch.float32),
    "parity_bf16": lambda ctx: parity(ctx, torch.bfloat16),
    "speed": speed,
    "trace": trace,
    "quantized_gather": quantized_gather,
    "dist_muon": dist_muon,
    "unused_grads": unused_grads,
}


def _init(dry_run: bool) -> tuple[torch.device, int, int]:
    """One process (W = 1) unless torchrun set the environment."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if dry_run:
        dist.init_process_group("gloo")
        return torch.device("cpu"), dist.get_rank(), dist.get_world_size()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run to check the script on CPU)")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    return device, dist.get_rank(), dist.get_world_size()


def _markdown(meta: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"# gpu_check: W = {meta['world_size']}, {meta['device_name']}",
        "",
        f"torch {meta['torch']}, {meta['backend']}, {meta['date']}"
        + (" (dry run: CPU/gloo, tiny shapes)" if meta["dry_run"] else ""),
        "",
        "| check | ok | figures |",
        "| --- | --- | --- |",
    ]
    for name, result in results.items():
        figures = {k: v for k, v in result.items() if k not in ("ok", "error")}
        text = result.get("error", json.dumps(figures, default=str))
        lines.append(f"| {name} | {'yes' if result['ok'] else '**no**'} | {text[:400]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dry-run", action="store_true", help="CPU/gloo, tiny shapes")
    p.add_argument("--checks", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    args = p.parse_args(argv)
    device, rank, world = _init(args.dry_run)
    if device.type == "cuda":  # bitwise parity needs deterministic kernels on both sides
        torch.use_deterministic_algorithms(True, warn_only=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(device, init_device_mesh(device.type, (world,)), rank, world, args.dry_run, args.out)
    results: dict[str, dict[str, Any]] = {}
    for name in args.checks:
        started = time.perf_counter()
        try:
            results[name] = CHECKS[name](ctx)
        except Exception:  # report and go on: one prepared run has to tell everything
            results[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
        results[name]["seconds"] = round(time.perf_counter() - started, 1)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    meta = {
        "world_size": world,
        "dry_run": args.dry_run,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if rank == 0:
        stem = f"gpu_check_w{world}"
        write_results(args.out, stem, meta, [results], _markdown(meta, results))
        print((args.out / f"{stem}.md").read_text())
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
