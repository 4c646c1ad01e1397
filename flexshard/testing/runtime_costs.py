"""What a sharded eager step costs beyond its ops timed one by one, for the CPU
profile (``benchmarks/plan_launch.py``), on a tiny-width copy of the model
(:func:`tiny_config`: same layers, heads and op sequence; widths of 32, a few tokens, so
the ops' own work is negligible), all W ranks at once:

- ``eager_op_us``: the tiny model run forward + backward end to end, less its ops
  timed one by one (x contention), per op dispatched: autograd's graph and engine,
  nn.Module calls, Python between ops;
- ``<backend>_gather_param_us`` / ``_reduce_param_us``: the same tiny model set up by
  the trainer (``train.setup``, flexshard and FSDP2, the buckets of the real rows),
  forward and backward timed against the unsharded tiny model's, less the time
  spent inside the all-gather / reduce-scatter calls (timed around gloo's calls):
  the hooks, unshard / reshard bookkeeping, copy-out and pack loops, gradient
  landing, per parameter gathered (forward) and per parameter reduced (backward,
  after its re-gathers at the forward's per-parameter cost);
- ``collective_wait_us``: the same tiny steps' all-gather / reduce-scatter calls,
  per call, against the same calls (the same mean size, fresh buffers) started
  together after a barrier: what a step's collective waits for the slower rank
  (the ranks drift apart between two collectives; every other micro-benchmark
  starts its ranks together).

None of this reads the rows ``benchmarks/plan_validation.py`` measures: the tiny model
is not a validated row. The values go to the profile's ``HostCosts``
(``flexshard.plan.host_costs``)."""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flexshard.plan.oprecord import record_model
from flexshard.torch_internals import fsdp_param_group
from flexshard.trainer.config import Config
from flexshard.trainer.model import Transformer

from ..torch_internals import all_gather_single, reduce_scatter_single
from .op_replay import op_rates

TINY_STEPS = 12  # timed forward / backward passes of the tiny model (after 3 warm-up)


def tiny_config(cfg: Config, backend: str) -> Config:
    """``cfg``'s model at widths of 32 (same layers, heads and kv heads), 8 tokens, one
    sequence, as ``backend`` shards it by its default layout."""
    tiny = copy.deepcopy(cfg)
    heads = tiny.model.n_heads
    tiny.model.dim = 4 * heads  # head dim 4 (RoPE needs an even one)
    tiny.model.ffn_hidden = 8 * heads
    tiny.model.vocab_size = 256  # the byte tokenizer's ids
    tiny.training.seq_len, tiny.training.batch_size = 8, 1
    tiny.parallelism.dp_backend, tiny.parallelism.placement = backend, "shard0"
    return tiny


def _passes(model: torch.nn.Module, tokens: torch.Tensor, timers: dict[str, float]) -> dict:
    """Median forward (+ loss) and backward seconds over TINY_STEPS, and in each the
    seconds inside collectives and the all-gather / reduce-scatter calls made."""
    from flexshard.trainer.train import loss_fn

    keys = ("collective", "all_gather_single", "reduce_scatter_single")
    rows = []
    for step in range(TINY_STEPS + 3):
        dist.barrier()
        c0 = {k: timers[k] for k in keys}
        a = time.perf_counter()
        loss = loss_fn(model(tokens), tokens)
        b = time.perf_counter()
        c1 = {k: timers[k] for k in keys}
        loss.backward()
        c = time.perf_counter()
        c2 = {k: timers[k] for k in keys}
        model.zero_grad(set_to_none=True)
        if step >= 3:
            row = {"forward": b - a, "backward": c - b}
            for k in keys:
                row[f"forward {k}"] = c1[k] - c0[k]
                row[f"backward {k}"] = c2[k] - c1[k]
            rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _timed_collectives(timers: dict[str, float]) -> Callable[[], None]:
    """Time gloo's all-gather / reduce-scatter calls to their completion (flexshard
    issues them async and waits at launch; FSDP2 on CPU calls them synchronously)
    and count them."""
    names = ("all_gather_single", "reduce_scatter_single")
    # torch's functions under this release's names (all_gather_into_tensor before 2.13)
    originals = {
        "all_gather_single": all_gather_single,
        "reduce_scatter_single": reduce_scatter_single,
    }
    timers.update(dict.fromkeys(("collective", "numel", *names), 0.0))

    def timed(name: str, original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            work = original(*args, **kwargs)
            if work is not None:
                work.wait()
            timers["collective"] += time.perf_counter() - begin
            timers[name] += 1
            # the whole buffer (an all-gather's output, a reduce-scatter's input): the
            # largest tensor passed, positionally (flexshard) or by name (FSDP2)
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            timers["numel"] += max(t.numel() for t in tensors)
            return work

        return call

    # wrapped wherever bound: torch.distributed (FSDP2's calls) and every module that
    # imported the function under its own name (flexshard's, through torch_internals)
    wrapped = {id(fn): timed(name, fn) for name, fn in originals.items()}
    patched = []
    for module in list(sys.modules.values()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if any(value is fn for fn in originals.values()):
                patched.append((module, attr, value))
                setattr(module, attr, wrapped[id(value)])

    def undo() -> None:
        for module, attr, value in patched:
            setattr(module, attr, value)

    return undo


def _barrier_call_s(numel: int, world: int, reps: int = 11) -> float:
    """A collective of ``numel`` elements (the whole buffer) with every rank started
    together (a barrier first), fresh buffers as the runtime uses them: the mean of
    an all-gather's and a reduce-scatter's median."""
    shard = max(1, numel // world)
    local, src = torch.randn(shard), torch.randn(shard * world)
    medians = []
    for gather in (True, False):
        times = []
        for _ in range(reps):
            full = torch.empty(shard * world) if gather else src.clone()
            dist.barrier()
            begin = time.perf_counter()
            if gather:
                all_gather_single(full, local)
            else:
                reduce_scatter_single(torch.empty(shard), full)
            times.append(time.perf_counter() - begin)
        medians.append(statistics.median(times[1:]))
    return sum(medians) / 2


def _params_per_bucket(model: torch.nn.Module, backend: str) -> float:
    """Mean parameters per bucket (flexshard) or per FSDP2 parameter group."""
    if backend == "flexshard":
        from flexshard.runtime.module import subtree_buckets

        sizes = [len(b.layout.params) for b in subtree_buckets(model)]
    else:
        groups = (fsdp_param_group(module) for module in model.modules())
        sizes = [len(group.fsdp_params) for group in groups if group is not None]
    if not sizes:
        raise RuntimeError(f"runtime_costs: no {backend} buckets found on the tiny model")
    return sum(sizes) / len(sizes)


def runtime_costs(cfg: Config, world: int, contention: float) -> dict[str, float]:
    """``eager_op_us`` and the per-parameter runtime costs of both backends, on the
    tiny copy of ``cfg``'s model (every rank of the launch calls it)."""
    from flexshard.trainer.train import setup

    torch.set_num_threads(1)
    timers: dict[str, float] = {}
    undo = _timed_collectives(timers)
    keys = ("all_gather_single", "reduce_scatter_single")
    in_step: list[tuple[float, float]] = []  # (seconds in collectives, calls) per backend
    try:
        plain_cfg = tiny_config(cfg, "flexshard")
        torch.manual_seed(0)
        tokens = torch.randint(0, plain_cfg.model.vocab_size, (1, plain_cfg.training.seq_len))
        plain = _passes(Transformer(plain_cfg.model), tokens, timers)
        _, detail = op_rates([plain_cfg], reps=3)
        one_by_one = detail["gemm_s"] + detail["attention_s"] + detail["non_gemm_s"]
        ops = sum(record_model(plain_cfg).counts.values())
        wall = plain["forward"] + plain["backward"]
        out = {"eager_op_us": max(0.0, wall - contention * one_by_one) / ops * 1e6}
        for backend in ("flexshard", "fsdp2"):
            tiny = tiny_config(cfg, backend)
            job = setup(tiny)
            s = _passes(job.model, tokens, timers)
            per_bucket = _params_per_bucket(job.model, backend)
            # parameters moved per phase: (calls) x (parameters per bucket)
            forward = s["forward all_gather_single"] * per_bucket
            again = s["backward all_gather_single"] * per_bucket
            reduced = s["backward reduce_scatter_single"] * per_bucket
            fwd = s["forward"] - s["forward collective"] - plain["forward"]
            bwd = s["backward"] - s["backward collective"] - plain["backward"]
            gather = max(0.0, fwd) / max(forward, 1.0)
            reduce = max(0.0, bwd - gather * again) / max(reduced, 1.0)
            out[f"{backend}_gather_param_us"] = gather * 1e6
            out[f"{backend}_reduce_param_us"] = reduce * 1e6
            out[f"{backend}_calls"] = (forward, again, reduced)  # type: ignore[assignment]
            calls = sum(s[f"{p} {k}"] for p in ("forward", "backward") for k in keys)
            in_step.append((s["forward collective"] + s["backward collective"], calls))
            del job
        # the same calls started together: what the step's calls wait on top is the
        # ranks' drift between two collectives (the slower rank sets the start)
        numel = round(timers["numel"] / max(sum(timers[k] for k in keys), 1.0))
    finally:
        undo()
    per_call = sum(t for t, _ in in_step) / max(sum(c for _, c in in_step), 1.0)
    out["collective_wait_us"] = max(0.0, per_call - _barrier_call_s(numel, world)) * 1e6
    return out
