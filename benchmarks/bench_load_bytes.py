"""Bytes read from storage per checkpoint load, summed over every process of the job,
against the checkpoint's size on disk; and the load's wall time.

    .venv/bin/python -m benchmarks.bench_load_bytes            # ~25M params + AdamW, ~8 min
    .venv/bin/python -m benchmarks.bench_load_bytes --quick    # ~3M params

Counted: ``rchar`` of ``/proc/self/io`` (bytes the process asked ``read``-family
syscalls for: files, pipes; gloo's sockets do not count, measured) taken by each
process around the load call itself, summed over the ranks, plus the launcher's
pre-flight (``check_before_start``) with the checkpoint minus the same call without
one. The windows hold the load and nothing else; a warm-up load first keeps lazy
imports (``.py`` files read) out of them.

Why not the launcher's ``rchar`` at the end of the job: Linux adds a reaped child's
counters to its parent's, so the launcher's total includes every rank's reads again.

Cases, at W = 4 (the checkpoints written by the trainer, one step of AdamW):

* resume: the trainer's resume (``maybe_resume``) as dp_replicate 2 x dp_shard 2 from
  a checkpoint saved in that layout, plus the launcher's pre-flight;
* initial_load_path: ``initial_load`` (model weights only) as 2 x 2 from that
  checkpoint, plus the pre-flight;
* reshard 2 -> 4: ``fs.checkpoint.load`` (the trainer's resume) as dp_shard 4 from a
  checkpoint saved at W = 2 (dp_shard 2);
* resume, Owned: the trainer's resume under Muon with ``placement = "muon"`` (each
  matrix whole on one rank, DistMuon's state with it), 2 x 2, from a checkpoint saved
  in that layout, plus the pre-flight.

Each case three ways, alternating: ``fs.checkpoint.load`` checking every checksum in a
pass of its own first (``checksums_first=True``), the default (DCP's read plan, each
chunk checked on the bytes the load reads), and ``reads="striped"`` (each stored chunk
read once and sent to the other ranks that need it); beside rchar, the bytes the
readers took from chunk files and the bytes the striped exchange moved (both counted
in process). Results: benchmarks/results/load_bytes.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.checkpoint import striped_read, verified_read
from flexshard.testing import run_distributed
from flexshard.testing.stats import alternating
from flexshard.trainer import train
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.preflight import check_before_start
from flexshard.trainer.config import config_from_dict
from flexshard.trainer.models.model import count_params

from .common import write_results

RESULTS = Path(__file__).parent / "results"
COMMAND = ".venv/bin/python -m benchmarks.bench_load_bytes"
CASES = ("resume", "initial_load_path", "reshard 2 -> 4", "resume, Owned")
#: the two ways ``fs.checkpoint.load`` checks the manifest's checksums
#: (the trainer's load, its [checkpoint] reads)
SIDES = {
    "dcp, checksums first": (functools.partial(fs.checkpoint.load, checksums_first=True), "dcp"),
    "dcp, on read": (fs.checkpoint.load, "dcp"),
    "striped": (fs.checkpoint.load, "striped"),
}


class Counters:
    """Bytes the loads' readers take from chunk files (``read_chunk``, both readers)
    and bytes the striped exchange receives over gloo, in this process."""

    chunks = 0
    received = 0

    @classmethod
    def install(cls) -> None:
        def counted_read(*args: Any) -> bytes:
            data = read_chunk(*args)
            cls.chunks += len(data)
            return data

        def counted_exchange(reader: Any, *args: Any) -> None:
            exchange(reader, *args)
            cls.received += args[2].numel()  # (progress, number, received, ...)

        verified_read.read_chunk = striped_read.read_chunk = counted_read
        striped_read.StripedReader._exchange = counted_exchange


read_chunk = verified_read.read_chunk
exchange = striped_read.StripedReader._exchange


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=5, help="measured loads per case")
    p.add_argument("--placement", default="shard0")
    p.add_argument("--folder", default="/tmp/flexshard_bench_load_bytes")
    p.add_argument("--quick", action="store_true", help="dim 192, 4 layers, 2 reps")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.reps = 192, 4, 2
    return args


def rchar() -> int:
    """Bytes this process has asked read-family syscalls for (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def _config(args: dict[str, Any], name: str, replicate: int, shard: int, **ckpt: Any) -> Any:
    steps = ckpt.pop("steps", 1)
    optimizer = ckpt.pop("optimizer", "adamw")
    placement = args["placement"] if optimizer == "adamw" else "muon"
    return config_from_dict(
        {
            "model": {
                "dim": args["dim"],
                "n_layers": args["layers"],
                "n_heads": 8,
                "n_kv_heads": 4,
            },
            "parallelism": {
                "dp_replicate": replicate,
                "dp_shard": shard,
                "placement": placement,
            },
            "training": {
                "steps": steps,
                "seq_len": 32,
                "batch_size": 4,
                "seed": 1,
                "optimizer": optimizer,
            },
            "checkpoint": {"enable": True, "interval": 1, **ckpt},
            "job": {
                "dump_folder": f"{args['folder']}/{name}",
                "progress": False,
                "plot": False,
                "tensorboard": False,
                "log_every": 1000,
            },
        }
    )


def configs(args: dict[str, Any]) -> dict[str, Any]:
    """The cases' configs at W = 4 (each loads at its job's setup)."""
    saved = f"{args['folder']}/w4/checkpoint/step-1"
    return {
        "resume": _config(args, "w4", 2, 2, steps=2),
        "initial_load_path": _config(args, "initial", 2, 2, enable=False, initial_load_path=saved),
        "reshard 2 -> 4": _config(args, "w2", 1, 4, steps=2),
        "resume, Owned": _config(args, "owned", 2, 2, steps=2, optimizer="muon"),
    }


def _save_w2(rank: int, world_size: int, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    train.run(_config(args, "w2", 1, 2))


def _load(case: str, side: str, job: Any) -> None:
    checkpointing.load, job.cfg.checkpoint.reads = SIDES[side]  # what the trainer's loads call
    if case == "initial_load_path":
        checkpointing.initial_load(job)
    else:
        checkpointing.maybe_resume(job)


def _measure(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, list]:
    """Save the 2 x 2 checkpoint, then per case one warm-up load and ``reps`` measured
    ones: this rank's rchar delta and the load's wall time (barrier to barrier)."""
    torch.set_num_threads(1)
    Counters.install()
    train.run(_config(args, "w4", 2, 2))
    train.run(_config(args, "owned", 2, 2, optimizer="muon"))
    cfgs = configs(args)
    jobs = {case: train.setup(cfg) for case, cfg in cfgs.items()}
    out: dict[str, list] = {f"{case}|{side}": [] for case in CASES for side in SIDES}
    for case in CASES:
        for side in SIDES:
            _load(case, side, jobs[case])
    for rep in range(args["reps"]):
        for case in CASES:
            for side in alternating(list(SIDES), rep):
                dist.barrier()
                chunks, received = Counters.chunks, Counters.received
                before, begin = rchar(), time.perf_counter()
                _load(case, side, jobs[case])
                read = rchar() - before
                dist.barrier()
                wall = time.perf_counter() - begin
                sample = (read, wall, Counters.chunks - chunks, Counters.received - received)
                out[f"{case}|{side}"].append(sample)
    return out


def preflight_bytes(cfg: Any, reps: int) -> list[int]:
    """The pre-flight's rchar with ``cfg``'s checkpoint minus the same without it."""
    bare = config_from_dict({**cfg.to_dict(), "checkpoint": {"enable": False}})
    check_before_start(cfg, 4)  # warm-up: the lazy imports read their files once
    check_before_start(bare, 4)
    deltas = []
    for rep in range(reps):
        reads = {}
        for which, c in alternating((("with", cfg), ("without", bare)), rep):
            before = rchar()
            check_before_start(c, 4)
            reads[which] = rchar() - before
        deltas.append(reads["with"] - reads["without"])
    return deltas


def disk_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def summarise(
    per_rank: list[dict[str, list]], pre: dict[str, list[int]], sizes: dict[str, int]
) -> list[dict[str, Any]]:
    rows = []
    for key in per_rank[0]:
        case, side = key.split("|")
        reps = len(per_rank[0][key])
        ranks = [statistics.median(r[key][i][0] for i in range(reps)) for r in per_rank]
        chunks = sum(statistics.median(r[key][i][2] for i in range(reps)) for r in per_rank)
        received = sum(statistics.median(r[key][i][3] for i in range(reps)) for r in per_rank)
        walls = [max(r[key][i][1] for r in per_rank) for i in range(reps)]
        flight = statistics.median(pre[case]) if case in pre else 0
        total = sum(ranks) + flight
        size = sizes[case]
        rows.append(
            {
                "case": case,
                "read": side,
                "checkpoint_mb": size / 1e6,
                "preflight_mb": flight / 1e6,
                "ranks_mb": sum(ranks) / 1e6,
                "per_rank_mb": [r / 1e6 for r in ranks],
                "total_mb": total / 1e6,
                "ratio": total / size,
                "chunks_mb": chunks / 1e6,
                "received_mb": received / 1e6,
                "wall_s": statistics.median(walls),
                "wall_iqr_s": iqr(walls),
                "wall_s_all": walls,
            }
        )
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Bytes read per checkpoint load (W = 4)",
        "",
        f"`{meta['command']}` — {meta['when']}, {meta['machine']}, torch {meta['torch']}, "
        f"{meta['params'] / 1e6:.1f}M params (dim {meta['dim']}, {meta['layers']} layers), "
        f"AdamW, placement {meta['placement']}, {meta['reps']} loads per case, "
        f"load average {meta['load']}",
        "",
        "| case | read | checkpoint on disk MB | pre-flight MB | ranks MB (per rank) | "
        "total / checkpoint | chunk reads MB | sent between ranks MB | "
        "load wall s, median [IQR] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = ", ".join(f"{x:.0f}" for x in r["per_rank_mb"])
        lines.append(
            f"| {r['case']} | {r['read']} | {r['checkpoint_mb']:.1f} | "
            f"{r['preflight_mb']:.2f} | {r['ranks_mb']:.1f} ({per}) | {r['ratio']:.2f}x | "
            f"{r['chunks_mb']:.1f} | {r['received_mb']:.1f} | "
            f"{r['wall_s']:.2f} [{r['wall_iqr_s'][0]:.2f}, {r['wall_iqr_s'][1]:.2f}] |"
        )
    lines += ["", *meta["notes"]]
    return "\n".join(lines) + "\n"


def iqr(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4)
    return (q[0], q[2])


NOTES = [
    "Bytes: rchar (/proc/self/io) of each rank around the load call (gloo's sockets do not",
    "count: the striped rows' rchar is their chunk reads plus .metadata, not the bytes sent),",
    "median over the loads, summed over the 4 ranks; pre-flight: the launcher's",
    "check_before_start with the",
    "checkpoint minus without it. Checkpoint: every file of the folder loaded (chunks,",
    ".metadata, manifest, extras). Wall: barrier to barrier, the slowest rank.",
    "initial_load_path loads model weights only (a third of an AdamW checkpoint).",
    "Read: `fs.checkpoint.load(..., checksums_first=True)` (every checksum in a pass of",
    "its own before the read), the default (DCP's plan, each chunk checked on the bytes",
    'read) and `reads="striped"` (each chunk read once, by one rank, and sent to the',
    "others), alternating within each case. Chunk reads: the bytes the readers took from",
    "chunk files (instrumented; checksums first reads through torch's reader: not counted).",
    "Sent between ranks: what the striped exchange received, summed over the ranks.",
]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = vars(args).copy()
    config.pop("out")
    shutil.rmtree(args.folder, ignore_errors=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    run_distributed(_save_w2, 2, config, timeout=900)
    per_rank = run_distributed(_measure, 4, config, timeout=1800)
    cfgs = configs(config)
    pre = {case: preflight_bytes(cfgs[case], args.reps) for case in CASES if "2 -> 4" not in case}
    w4, w2 = (f"{args.folder}/{n}/checkpoint/step-1" for n in ("w4", "w2"))
    sizes = {"resume": disk_bytes(w4), "initial_load_path": disk_bytes(w4)}
    sizes["reshard 2 -> 4"] = disk_bytes(w2)
    sizes["resume, Owned"] = disk_bytes(f"{args.folder}/owned/checkpoint/step-1")
    rows = summarise(per_rank, pre, sizes)
    total, _ = count_params(cfgs["resume"].model)
    flags = argv if argv is not None else sys.argv[1:]
    meta = {
        "command": " ".join([COMMAND, *flags]),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "dim": args.dim,
        "layers": args.layers,
        "params": total,
        "placement": args.placement,
        "reps": args.reps,
        "load": load,
        "notes": NOTES,
    }
    text = markdown(meta, rows)
    write_results(args.out, "load_bytes" + ("_quick" if args.quick else ""), meta, rows, text)
    print(text)


if __name__ == "__main__":
    main()
