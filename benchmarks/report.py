"""The Markdown page of a data-parallel benchmark run."""

from __future__ import annotations

from typing import Any

from flexshard.testing.stats import RULE, cell, range_cell, verdict_cell

MB = 2**20

NOTES = """\
How to read it:
- **median ms**: per timed step the slowest rank's forward+backward+`optimizer.step()`
  (a `dist.barrier()` before each step), the median over the steps of a repetition,
  then the median over repetitions. fwd / bwd / opt are medians per phase over all
  timed steps.
- **step / FSDP2**: per repetition this configuration's median step over FSDP2's median
  step in the same repetition (the order of the configurations is reversed on every
  other repetition, so each runs after FSDP2 in one and before it in the next); the
  median over repetitions [interquartile range], and min–max. **step verdict**: against
  the target flexshard step <= 0.95x FSDP2. A row marked "(vs fsdp2/all_layers)"
  is compared with FSDP2 in its own grouping: `flex/owned_all_layers` (one Owned bucket,
  one all-gather, for all blocks) against `fsdp2/all_layers` (`fully_shard` given the
  list of blocks: one FSDP2 group for all of them); its ratios against per-block FSDP2
  are in the JSON (`vs_per_block_fsdp2`).
- **peak RSS MB**: per rank, VmHWM (reset through `/proc/self/clear_refs` once the model is
  sharded and glibc's free pages are trimmed) minus the RSS before the model was built;
  max over ranks, median over repetitions. It includes glibc's cached free memory and
  gloo buffers, so it over-states live memory. **RSS / FSDP2** and its verdict: the
  same per-repetition pairing, target <= 1.00. **live MB**: distinct CPU tensor storages
  reachable from Python after the last step (parameters, gradients, optimizer state and
  whatever the library keeps), minus the same count before the model was built.
- **peak live MB** (memory table): one extra, untimed step after the timed ones under
  `flexshard/testing/live_memory.py`'s `LiveTensors` (a `TorchDispatchMode` that counts every
  CPU tensor storage an op produces or `UntypedStorage.resize_` sizes, until it dies):
  the peak bytes of live tensors minus those before the model was built, on the rank
  with the highest peak. At that peak, the storages are named by role: sharded params
  (flexshard: the bucket storage, padding included), optimizer state, unsharded params
  (flexshard: the all-gather buffer and full parameters; FSDP2: all-gather outputs and
  unsharded parameters), sharded grads; the rest by the phase that allocated them (fwd:
  activations and the flat all-gather output FSDP2 copies out of; bwd: unsharded
  gradients, reduce-scatter buffers, temporaries). gloo's internal copies and the
  allocator's cache are not tensors: RSS minus peak live is where they show.
- **coll/step**, **MB sent/step**: collectives one rank issues per step and the bytes it
  sends, ring algorithm (`(W-1) x` per-rank chunk for all-gather / reduce-scatter,
  flexshard's `CommStats` formula), counted by wrapping `torch.distributed` for every
  configuration (for flexshard it is checked against `model.comm_stats()`). flexshard's
  one AR is the end-of-backward agreement on parameters no rank used (a few bytes).
- **vs min**: bytes sent / the same collectives without padding (`(W-1)/W x` unpadded
  bucket bytes each). 1.00 means no padding is sent.
- **x params**: bytes sent / `(W-1)/W x` all parameter bytes. Each block bucket moves
  its parameters three times a step (forward all-gather, backward re-gather,
  reduce-scatter), the root / outer bucket twice (not resharded after forward), so the
  no-padding value here is 3 - (outer share of the parameters).
- **max pad %**: the largest bucket's `(W x shard_numel - numel) / (W x shard_numel)`.
  For Owned the bracket gives the least padding any whole-parameter assignment of
  that bucket could reach (the largest parameter, or an even split, on one rank).
"""


def _config(r: dict[str, Any]) -> str:
    """The row's name, and its reference when that is not per-block FSDP2."""
    if r.get("reference", "fsdp2") == "fsdp2" or r["config"] == r["reference"]:
        return r["config"]
    return f"{r['config']} (vs {r['reference']})"


def time_row(r: dict[str, Any]) -> str:
    step, rss = r["step_vs_fsdp2"], r["rss_vs_fsdp2"]
    cells = [
        r["world_size"],
        _config(r),
        f"{r['median_ms']:.1f}",
        cell(step),
        range_cell(step),
        verdict_cell(step),
        f"{r['forward_ms']:.1f} / {r['backward_ms']:.1f} / {r['optimizer_ms']:.1f}",
        f"{r['peak_rss_mb']:.1f}",
        cell(rss, 3),
        verdict_cell(rss),
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


TIME_HEADER = (
    "| W | config | median ms | step / FSDP2 [IQR] | min–max | step verdict "
    "| fwd / bwd / opt ms | peak RSS MB | RSS / FSDP2 [IQR] | RSS verdict |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def comm_row(r: dict[str, Any]) -> str:
    comm = r["comm"]
    pad = f"{100 * r['max_padding']:.1f}"
    if "owned" in r["config"]:
        floor = max(b["padding_floor"] for b in r["buckets"])
        pad += f" [{100 * floor:.1f}]"
    cells = [
        r["world_size"],
        r["config"],
        f"{r['live_tensor_mb']:.1f}",
        f"{comm['collectives']} ({comm['all_gather']} AG, {comm['reduce_scatter']} RS"
        + (f", {comm['all_reduce']} AR)" if comm.get("all_reduce") else ")"),
        f"{comm['bytes_sent'] / MB:.2f}",
        f"{r['bytes_vs_min']:.3f}",
        f"{r['bytes_vs_model']:.2f}",
        pad,
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


COMM_HEADER = (
    "| W | config | live MB | coll/step | MB sent/step | vs min | x params | max pad % |\n"
    "|---|---|---|---|---|---|---|---|"
)


#: what was alive at the live-tensor peak, in the memory table's column order
AT_PEAK = (
    "sharded params",
    "optimizer state",
    "unsharded params",
    "sharded grads",
    "forward",
    "backward",
    "optimizer",
)


def memory_row(r: dict[str, Any]) -> str:
    parts = dict(r["at_peak_mb"])
    named = [parts.pop(k, 0.0) for k in AT_PEAK]
    cells = [
        r["world_size"],
        _config(r),
        f"{r['peak_rss_mb']:.1f}",
        f"{r['rss_vs_fsdp2']['median']:.3f}",
        f"{r['peak_live_mb']:.1f}",
        f"{r['live_vs_fsdp2']:.3f}",
        r["peak_live_phase"],
        *(f"{v:.1f}" for v in named),
        f"{sum(parts.values()):.1f}",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


MEMORY_HEADER = (
    "| W | config | peak RSS MB | RSS / FSDP2 | peak live MB | live / FSDP2 | peak in "
    "| sharded params | optim. state | unsharded params | sharded grads "
    "| fwd allocs | bwd allocs | optim. allocs | other |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def verdict_counts(rows: list[dict[str, Any]]) -> list[str]:
    """Per W, which flexshard rows meet the step and the memory targets."""
    lines = []
    for world in sorted({r["world_size"] for r in rows}):
        mine = [r for r in rows if r["world_size"] == world and not r["config"].startswith("fsdp2")]
        for key, label in (("step_vs_fsdp2", "step <= 0.95x"), ("rss_vs_fsdp2", "RSS <= 1.00x")):
            groups: dict[str, list[str]] = {}
            for r in mine:
                groups.setdefault(r[key]["verdict"], []).append(r["config"])
            text = "; ".join(f"{v}: {', '.join(n)}" for v, n in sorted(groups.items()))
            lines.append(f"- W={world}, {label}: {text}")
    return lines


def _bucket_padding(r: dict[str, Any]) -> str:
    """Padding per bucket, the identical per-block buckets folded into ``layers.*``."""
    worst: dict[str, float] = {}
    for b in r["buckets"]:
        key = "layers.*" if b["name"].startswith("layers.") else b["name"]
        worst[key] = max(worst.get(key, 0.0), b["padding"])
    return ", ".join(f"{k} {100 * v:.1f}" for k, v in worst.items())


def _padding_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| W | config | padding % per bucket | rank storage (elements, first block bucket) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        first = (
            r["buckets"][0] if r["buckets"][0]["name"].startswith("layers.") else r["buckets"][1]
        )
        lines.append(
            f"| {r['world_size']} | {r['config']} | {_bucket_padding(r)} "
            f"| {', '.join(map(str, first['rank_numels']))} |"
        )
    return lines


def _checks(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        problems = []
        if not r["comm_constant"]:
            problems.append("collectives differ between steps")
        if r["comm_stats_agree"] is False:
            problems.append("model.comm_stats() disagrees with the counted calls")
        if problems:
            lines.append(f"- W={r['world_size']} {r['config']}: " + "; ".join(problems))
    for world in sorted({r["world_size"] for r in rows}):
        losses = {r["config"]: r["final_loss_rank0"] for r in rows if r["world_size"] == world}
        spread = max(losses.values()) - min(losses.values())
        lines.append(
            f"- W={world}: last timed loss (rank 0) spread across configs {spread:.2e} "
            f"(FSDP2 {losses.get('fsdp2', float('nan')):.6f})"
        )
    return lines


def _load(load: list[float]) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    opts = meta["options"]
    model = opts["model"]
    lines = [
        "# Data-parallel step: torch FSDP2 vs flexshard",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; flexshard {meta['flexshard_revision']}; torch {meta['torch']}, "
        f"Python {meta['python']}; "
        f"machine: {meta['machine']}  ",
        f"Model: TinyTransformer {model}, batch {opts['batch_per_rank']} per rank, "
        f"{opts['optimizer']}; {opts['warmup']} warm-up + {opts['steps']} timed steps x "
        f"{opts['reps']} repetitions, FSDP2 in the middle of the order and the order "
        "reversed on every other repetition; "
        f"one bucket (FSDP2 group) per block plus the root/outer one. Total runtime "
        f"{meta['runtime_s']:.0f} s. Load average (1/5/15 min) at start "
        f"{_load(meta['load_average_at_start'])}, at end {_load(meta['load_average_at_end'])} "
        "(other processes share the machine: compare rows of one W, not runs).",
        "",
        RULE,
        "",
        TIME_HEADER,
        *(time_row(r) for r in rows),
        "",
        "Verdicts:",
        *verdict_counts(rows),
        "",
        COMM_HEADER,
        *(comm_row(r) for r in rows),
        "",
        "Memory: peak RSS against the peak of live tensors over one extra untimed step, and "
        "what was alive at that peak (MB, rank with the highest peak):",
        "",
        MEMORY_HEADER,
        *(memory_row(r) for r in rows),
        "",
        *_padding_table(rows),
        "",
        "Checks:",
        *_checks(rows),
        "",
        NOTES,
    ]
    return "\n".join(lines)
