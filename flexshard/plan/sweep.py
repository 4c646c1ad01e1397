"""Memory and bytes per rank against the world size: one plan per W, one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexshard.trainer.config import Config

from .hardware import Hardware
from .host_costs import NO_HOST_COSTS, HostCosts
from .report import make_plan

GiB = 2**30


def sweep(
    cfg: Config,
    worlds: list[int],
    hw: Hardware,
    backends: tuple[str, ...],
    host: HostCosts = NO_HOST_COSTS,
) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        plan = make_plan(cfg, world, hw, None, backends, host)
        for backend, p in plan["backends"].items():
            rows.append(
                {
                    "world": world,
                    "backend": backend,
                    "memory_gib": p["memory"]["total"] / GiB,
                    "state_gib": (
                        p["memory"]["params"] + p["memory"]["grads"] + p["memory"]["optimizer"]
                    )
                    / GiB,
                    "gathered_gib": p["memory"]["gathered_peak"] / GiB,
                    "bytes_gib": p["bytes_per_step"] / GiB,
                    "tokens_per_s_per_device": p["step"]["tokens_per_s_per_device"],
                }
            )
    return rows


def sweep_plot(
    cfg: Config,
    worlds: list[int],
    hw: Hardware,
    backends: tuple[str, ...],
    path: Path,
    host: HostCosts = NO_HOST_COSTS,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep(cfg, worlds, hw, backends, host)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("memory_gib", "memory per rank (GiB)"),
        ("bytes_gib", "bytes sent per rank per step (GiB)"),
        ("tokens_per_s_per_device", "tokens/s per device (model)"),
    )
    for ax, (key, title) in zip(axes, panels):
        for backend in backends:
            mine = [r for r in rows if r["backend"] == backend]
            ax.plot([r["world"] for r in mine], [r[key] for r in mine], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size W")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    lines = [
        "| W | backend | memory GiB | state GiB | gathered GiB | sent GiB/step | tok/s/dev |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['backend']} | {r['memory_gib']:.2f} | {r['state_gib']:.2f} | "
            f"{r['gathered_gib']:.2f} | {r['bytes_gib']:.2f} | "
            f"{r['tokens_per_s_per_device']:,.0f} |"
        )
    return "\n".join(lines) + f"\nplot: {path}"
