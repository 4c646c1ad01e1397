"""What a rank measures: memory (RSS and live tensor bytes), collectives it issues
(counted by wrapping torch.distributed) and the padding of every sharded bucket.

Where every side-by-side benchmark leaves its results: ``<stem>.json`` (meta and
raw rows), ``<stem>.md`` (the table quoted in the README) and the trainer benchmarks'
bar chart (tokens/s and peak RSS per rank of each backend, one group per case)."""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexshard.runtime.module import own_buckets
from flexshard.testing.stats import spread

MB = 1024 * 1024


# ---------------------------------------------------------------- memory
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: the process's high-water RSS since start or since ``reset_peak_rss``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Linux >= 4.0 resets VmHWM to the current RSS when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Collect garbage and hand glibc's cached free pages back to the OS, so that the
    next configuration's RSS does not start on memory the previous one freed."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage reachable from a Python tensor object.
    Tensors held only by C++ (autograd graph, gloo buffers) are not seen: call it
    between steps, when there are none."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                if storage.nbytes():  # freed (resized to 0) storages have no data pointer
                    storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # DTensor wrappers, meta
                continue
    return sum(storages.values())


class MemoryTracker:
    """Peak memory of one configuration, relative to the moment before its model exists.

    CUDA: the caching allocator's peak. CPU: (1) peak RSS (VmHWM, reset after the model
    is built so that the unsharded init model does not count), (2) RSS sampled before
    and after every step, (3) live tensor bytes between steps (params, grads, optimizer
    state and whatever the sharding library keeps). RSS includes glibc's cached free
    memory, so it over-states live memory; live tensor bytes miss transients.
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()

    def start(self) -> None:
        release_free_memory()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base_rss = torch.cuda.memory_allocated()
        else:
            self.base_rss = rss_bytes()
        self.base_live = live_tensor_bytes()
        self.sampled_peak = self.base_rss

    def model_built(self) -> None:
        release_free_memory()
        self.hwm_ok = self.cuda or reset_peak_rss()

    def sample(self) -> None:
        now = torch.cuda.memory_allocated() if self.cuda else rss_bytes()
        self.sampled_peak = max(self.sampled_peak, now)

    def finish(self) -> dict[str, float]:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = peak_rss_bytes() if self.hwm_ok else self.sampled_peak
        return {
            "peak_mb": (peak - self.base_rss) / MB,
            "sampled_peak_mb": (self.sampled_peak - self.base_rss) / MB,
            "live_tensor_mb": (live_tensor_bytes() - self.base_live) / MB,
            "peak_source": "cuda" if self.cuda else ("VmHWM" if self.hwm_ok else "sampled RSS"),
        }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the memory), a plain tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def held_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list]:
    """What a sharded model and its optimizer hold, by role (for ``LiveTensors.name``):
    sharded parameters (flexshard: each bucket's whole storage, padding included),
    unsharded parameters (flexshard: each bucket's all-gather buffer and full parameters;
    FSDP2: each parameter's all-gather outputs and unsharded parameter; freed or not),
    sharded gradients and optimizer state."""
    from torch.distributed.fsdp import FSDPModule

    params = [_local(p) for p in model.parameters()]
    unsharded: list[torch.Tensor | None] = []
    for module in model.modules():
        for bucket in own_buckets(module):
            params.append(bucket.storage)
            unsharded += [bucket.full.gathered, *map(_local, bucket.full_params)]
        if isinstance(module, FSDPModule):  # fs.fully_shard's modules are FSDPModules too
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in group.fsdp_params if group is not None else ():
                unsharded += fsdp_param.all_gather_outputs
                unsharded.append(getattr(fsdp_param, "_unsharded_param", None))
    state = [
        _local(t)
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]
    grads = [None if p.grad is None else _local(p.grad) for p in model.parameters()]
    return {
        "unsharded params": unsharded,
        "sharded params": params,
        "sharded grads": grads,
        "optimizer state": state,
    }


# ---------------------------------------------------------------- collectives
@dataclass
class CommRecord:
    kind: str  # all_gather | reduce_scatter | all_reduce
    sent: int  # bytes this rank sent, ring algorithm (flexshard's CommStats formula)
    total_numel: int  # gathered / reduced buffer, all ranks, padded
    element_size: int


@dataclass
class CollectiveCounter:
    """Counts the collectives issued through ``torch.distributed`` while installed.

    FSDP2 (torch 2.13) calls ``all_gather_single``/``reduce_scatter_single``; flexshard
    calls the deprecated ``*_into_tensor``/``*_tensor`` spellings, which forward to the
    module-private functions, so no call is counted twice.
    """

    records: list[CommRecord] = field(default_factory=list)
    _saved: dict[str, Callable] = field(default_factory=dict)

    def install(self) -> None:
        for name, kind in (
            ("all_gather_single", "all_gather"),
            ("all_gather_into_tensor", "all_gather"),
            ("reduce_scatter_single", "reduce_scatter"),
            ("reduce_scatter_tensor", "reduce_scatter"),
            ("all_reduce", "all_reduce"),
        ):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(self._saved[name], kind))

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, fn: Callable, kind: str) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.records.append(_record(kind, args, kwargs))
            return fn(*args, **kwargs)

        return counted

    def take(self) -> list[CommRecord]:
        records, self.records = self.records, []
        return records


def _record(kind: str, args: tuple, kwargs: dict) -> CommRecord:
    group = kwargs.get("group")
    size = dist.get_world_size(group)
    if kind == "all_reduce":
        tensor = args[0] if args else kwargs["tensor"]
        sent = 2 * (size - 1) * tensor.numel() * tensor.element_size() // size
        return CommRecord(kind, sent, tensor.numel(), tensor.element_size())
    names = ("output_tensor", "input_tensor") if kind == "all_gather" else ("output", "input")
    out = args[0] if args else kwargs.get(names[0])
    inp = args[1] if len(args) > 1 else kwargs.get(names[1])
    chunk = inp if kind == "all_gather" else out  # the per-rank piece
    full = out if kind == "all_gather" else inp
    sent = (size - 1) * chunk.numel() * chunk.element_size()
    return CommRecord(kind, sent, full.numel(), chunk.element_size())


# ---------------------------------------------------------------- bucket layouts
@dataclass(frozen=True)
class BucketInfo:
    name: str
    numel: int  # unpadded parameter elements
    padded_numel: int  # W * per-rank chunk, what one all-gather moves in total
    rank_numels: tuple[int, ...]  # unpadded elements each rank stores
    param_numels: tuple[int, ...]

    @property
    def padding(self) -> float:
        return (self.padded_numel - self.numel) / self.padded_numel if self.padded_numel else 0.0

    def padding_floor(self) -> float:
        """A lower bound on the padding of any whole-parameter (Owned) assignment: some
        rank holds the largest parameter, at least an even share, and, by pigeonhole,
        two of the W + 1 largest parameters."""
        world = len(self.rank_numels)
        sizes = sorted(self.param_numels, reverse=True)
        pair = sizes[world - 1] + sizes[world] if len(sizes) > world else 0
        most = max(sizes[0], math.ceil(self.numel / world), pair) * world
        return (most - self.numel) / most if most else 0.0


def flexshard_buckets(model: nn.Module) -> list[BucketInfo]:
    infos = []
    for module in model.modules():
        for bucket in own_buckets(module):
            layout = bucket.layout
            infos.append(
                BucketInfo(
                    bucket.name,
                    layout.numel,
                    layout.world_size * layout.shard_numel,
                    tuple(layout.rank_numel(r) for r in range(layout.world_size)),
                    tuple(p.numel for p in layout.params),
                )
            )
    return infos


def fsdp2_buckets(model: nn.Module, world_size: int) -> list[BucketInfo]:
    from torch.distributed.fsdp import FSDPModule

    infos, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or id(group) in seen:  # grouped fully_shard: one group, many modules
            continue
        seen.add(id(group))
        numels = [math.prod(p._orig_size) for p in group.fsdp_params]
        padded = [math.prod(p.padded_sharded_param_size) for p in group.fsdp_params]
        locals_ = [p.sharded_param.to_local().numel() for p in group.fsdp_params]
        infos.append(
            BucketInfo(
                name or "root",
                sum(numels),
                world_size * sum(padded),
                _gather_ints(sum(locals_), world_size),
                tuple(numels),
            )
        )
    return infos


def _gather_ints(value: int, world_size: int) -> tuple[int, ...]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value)
    return tuple(out)


def minimum_bytes(records: list[CommRecord], buckets: list[BucketInfo], world_size: int) -> float:
    """Bytes the same collectives would send with no padding: ``(W-1)/W x payload``,
    the payload being the unpadded bucket a collective of that padded size moves
    (twice that for an all-reduce, which is a reduce-scatter plus an all-gather)."""
    payload = {b.padded_numel: b.numel for b in buckets}
    total = 0.0
    for rec in records:
        numel = payload.get(rec.total_numel, rec.total_numel)
        passes = 2 if rec.kind == "all_reduce" else 1
        total += passes * (world_size - 1) / world_size * numel * rec.element_size
    return total


def write_results(out: Path, stem: str, meta: dict[str, Any], rows: list, text: str) -> Path:
    """Write ``stem``.json and ``stem``.md under ``out``; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(text)
    return path


#: the two panels: row key, y-axis label
PANELS = (
    ("tokens_per_s", "tokens/s (global), median and IQR"),
    ("peak_rss_mb", "peak RSS per rank, MB, median and IQR"),
)


def plot_backends(
    groups: dict[str, list[dict]],
    backends: tuple[str, ...],
    path: Path,
    title: str,
    *,
    figsize: tuple[float, float],
    capsize: int,
    rotate: bool = False,
) -> None:
    """One bar per backend in each group (tick label -> its rows, one per backend);
    ``rotate``: slant long tick labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(groups)
    fig, axes = plt.subplots(1, 2, figsize=figsize)
    for ax, (key, label) in zip(axes, PANELS):
        for i, backend in enumerate(backends):
            picked = [
                spread(r["per_rep"][key])
                for n in names
                for r in groups[n]
                if r["backend"] == backend
            ]
            ax.bar(
                [x + 0.38 * i for x in range(len(names))],
                [p.median for p in picked],
                yerr=[[p.median - p.q1 for p in picked], [p.q3 - p.median for p in picked]],
                width=0.36,
                label=backend,
                capsize=capsize,
            )
        ticks = [x + 0.19 for x in range(len(names))]
        if rotate:
            ax.set_xticks(ticks, names, rotation=30, ha="right")
        else:
            ax.set_xticks(ticks, names)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
