"""Where every side-by-side benchmark leaves its results: ``<stem>.json`` (meta and
raw rows), ``<stem>.md`` (the table quoted in the README) and the trainer benchmarks'
bar chart (tokens/s and peak RSS per rank of each backend, one group per case)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flexshard.testing.stats import spread


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
