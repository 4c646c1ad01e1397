"""Muon at scale, planned (H100 profile): the trainer's ``placement = "muon"`` (per-block
ragged buckets, matrices and experts whole on owners balanced across the model,
DistMuon without a collective where they are owned) against the baseline a user has
today, FSDP2 with a redistributing DistMuon: the FSDP2 column of the same config's
per-block plan (``placement = "shard0"``, every parameter ``Shard(0)``).

    .venv/bin/python -m benchmarks.muon_scale          # the table (about a minute)

Writes benchmarks/results/muon_scale.md. A plan whose peak exceeds the device's memory
is marked: its other figures describe a run that cannot happen.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path
from typing import Any

from flexshard.plan.hardware import H100
from flexshard.plan.report import make_plan
from flexshard.trainer.config import load_config

RESULTS = Path(__file__).parent / "results"
CONFIGS = Path(__file__).parent.parent / "configs"
GiB = 2**30

#: (config, world): the rows the issue's table names, at the configs' own tp / ep
ROWS: list[tuple[str, int]] = [
    ("llama3_8b", 64),
    ("llama3_8b", 1024),
    ("llama3_70b", 256),
    ("llama3_70b", 1024),
    ("deepseek_v3", 256),
    ("deepseek_v3", 2048),
    ("qwen3_moe_30b_a3b", 64),
]
TARGETS = (
    "gathered <= 1.05x, bytes <= 1.0x, storage max/mean <= 1.05, optimizer <= 0.5x, step <= 0.97x"
)


def _plan(config: str, world: int, placement: str, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        overrides = [
            "--training.optimizer",
            "muon",
            "--parallelism.placement",
            placement,
            "--job.dump_folder",
            folder,
        ]
        cfg = load_config(str(CONFIGS / f"{config}.toml"), overrides)
        plan = make_plan(cfg, world, H100, None, (backend,))
    return {"mesh": plan["mesh"], **plan["backends"][backend]}


def _figures(p: dict[str, Any]) -> dict[str, float]:
    step = p["step"]
    return {
        "memory_gib": p["memory"]["total"] / GiB,
        "gathered_gib": p["memory"]["gathered_peak"] / GiB,
        "padding": max(b["padding"] for b in p["buckets"]),
        "storage": max(s["max_over_mean"] for s in p["storage_balance"]),
        "bytes_gib": p["bytes_per_step"] / GiB,
        "optimizer_ms": step["optimizer_s"] * 1e3,
        "gather_all_ms": (p["muon_gather_all_s"] or 0.0) * 1e3,
        "step_ms": step["step_s"] * 1e3,
        "tokens": step["tokens_per_s_per_device"],
    }


def _mesh(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k} {v}" for k, v in mesh.items() if v > 1)


def rows() -> list[dict[str, Any]]:
    out = []
    for config, world in ROWS:
        ours = _plan(config, world, "muon", "flexshard")
        base = _plan(config, world, "shard0", "fsdp2")
        out.append(
            {
                "config": config,
                "world": world,
                "mesh": _mesh(ours["mesh"]),
                "ours": _figures(ours),
                "base": _figures(base),
            }
        )
    return out


def _fits(f: dict[str, float]) -> str:
    return "" if f["memory_gib"] <= H100.memory_gib else " **(does not fit)**"


def markdown(table: list[dict[str, Any]]) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Muon at scale, planned: flexshard's muon layout vs FSDP2 + redistributing DistMuon",
        "",
        f"`.venv/bin/python -m benchmarks.muon_scale`, {now}, H100 profile "
        f'({H100.memory_gib:g} GiB). Each cell: flexshard `placement = "muon"` vs the FSDP2 '
        'column of the same config\'s per-block plan (`placement = "shard0"`), both with '
        f'`training.optimizer = "muon"`. Targets: {TARGETS}.',
        "",
        "| config, world (mesh) | peak GiB/rank | gathered in flight (GiB) | max bucket "
        "padding | storage max/mean | bytes sent/step (GiB) | optimizer step (ms) | "
        "step (ms) | tokens/s/device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        o, b = r["ours"], r["base"]
        lines.append(
            f"| {r['config']}, {r['world']:,} ({r['mesh']}) "
            f"| {o['memory_gib']:.2f}{_fits(o)} vs {b['memory_gib']:.2f}{_fits(b)} "
            f"| {o['gathered_gib']:.2f} vs {b['gathered_gib']:.2f} "
            f"({o['gathered_gib'] / b['gathered_gib']:.3f}x) "
            f"| {o['padding']:.1%} vs {b['padding']:.1%} "
            f"| {o['storage']:.3f} vs {b['storage']:.3f} "
            f"| {o['bytes_gib']:.1f} vs {b['bytes_gib']:.1f} "
            f"({o['bytes_gib'] / b['bytes_gib']:.3f}x) "
            f"| {o['optimizer_ms']:.1f} vs {b['optimizer_ms']:.1f} "
            f"({o['optimizer_ms'] / b['optimizer_ms']:.2f}x) "
            f"| {o['step_ms']:,.0f} vs {b['step_ms']:,.0f} ({o['step_ms'] / b['step_ms']:.3f}x) "
            f"| {o['tokens']:,.0f} vs {b['tokens']:,.0f} |"
        )
    lines += [
        "",
        "Optimizer step against a Muon that all-gathers every matrix on every rank (the "
        "baseline of FlexShard's published -79% at DeepSeek-V3 / 256 H100):",
        "",
        "| config, world | flexshard muon (ms) | gather every matrix (ms) | saving |",
        "|---|---|---|---|",
    ]
    for r in table:
        o = r["ours"]
        saving = 1 - o["optimizer_ms"] / o["gather_all_ms"] if o["gather_all_ms"] else 0.0
        lines.append(
            f"| {r['config']}, {r['world']:,} | {o['optimizer_ms']:.1f} "
            f"| {o['gather_all_ms']:,.1f} | {saving:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS / "muon_scale.md")
    args = p.parse_args(argv)
    text = markdown(rows())
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
