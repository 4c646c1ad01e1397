"""Published runs flexshard-plan is compared against: the rows of
``flexshard-plan --validate`` (``flexshard/plan/published.py``) and the block-FP8
all-gather's step-time change."""

from __future__ import annotations

import dataclasses
from typing import Any

from flexshard.plan.hardware import H100
from flexshard.plan.published import METRIC_LABEL, ROWS, validate
from flexshard.plan.report import build_stages, planning_config
from flexshard.plan.steptime import step_time
from flexshard.trainer.config import load_config


def published_rows() -> list[dict[str, Any]]:
    """Every published row of ``flexshard-plan --validate`` (fitted on its calibration
    rows), with the block-FP8 all-gather row, for ``benchmarks.plan_validation``."""
    _, table = validate()
    rows = [
        {
            "name": f"{r['key']}: {r['layout']} ({r['source']})",
            "published": r["published"],
            "metric_label": METRIC_LABEL[r["metric"]],
            "backend": next(x.run.backend for x in ROWS if x.key == r["key"]),
            "predicted": r["predicted"],
            "gap": r["error"],
            "caveat": r["role"],
        }
        for r in table
    ]
    return [*rows, fp8_gather_row()]


def fp8_gather_row() -> dict[str, Any]:
    """Llama 3 405B at 256 H100 (tp 8 x FSDP 32): step time with block-FP8 all-gathers
    (1 byte per element; the fp32 scale per 128x128 tile, 0.02%, left out) over bf16."""
    cfg = planning_config(
        load_config(
            "configs/llama3_405b.toml", ["--parallelism.pp", "1", "--training.batch_size", "1"]
        )
    )
    dims, (buckets,) = build_stages(cfg, 256, 0)
    bf16 = step_time(cfg, dims, buckets, H100, None, "flexshard").step_s
    fp8_buckets = [dataclasses.replace(b, gather_itemsize=1) for b in buckets]
    fp8 = step_time(cfg, dims, fp8_buckets, H100, None, "flexshard").step_s
    change = fp8 / bf16 - 1
    return {
        "name": "Llama 3 405B, 256 H100 (tp 8 x FSDP 32, batch 1): block-FP8 all-gather",
        "source": "flex_shard's published figure",
        "config": "configs/llama3_405b.toml",
        "world": 256,
        "backends": ["flexshard"],
        "metric": "step time change",
        "metric_label": "step-time change (%)",
        "published": -20.0,
        "backend": "flexshard",
        "predicted": change * 100,
        "gap": (change * 100) / -20.0 - 1,
        "caveat": f"bf16 {bf16 * 1e3:,.0f} ms -> FP8 {fp8 * 1e3:,.0f} ms; the published "
        "layout and batch are not known here",
    }
