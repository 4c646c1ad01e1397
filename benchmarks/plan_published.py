"""Published runs flexshard-plan is compared against (figures as published; the
configs are our trainer's closest equivalents, differences named in ``caveat``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from flexshard.plan.hardware import H100
from flexshard.plan.report import build_stages, planning_config
from flexshard.plan.steptime import step_time
from flexshard.trainer.config import load_config

TT = "torchtitan docs/performance.md (H100 500 W, 400 Gb/s per GPU)"
LLAMA_VOCAB = ["--model.vocab_size", "128256"]
TPS = "tokens/s per GPU"

PUBLISHED: list[dict[str, Any]] = [
    {
        "name": "Llama 3.1 8B, 8 H100, FSDP, local batch 2 (torchtitan table 1)",
        "source": TT,
        "config": "configs/llama3_8b.toml",
        "world": 8,
        "overrides": [*LLAMA_VOCAB, "--training.batch_size", "2"],
        "backends": ["fsdp2"],
        "metric": "tokens_per_s_per_device",
        "metric_label": TPS,
        "published": 5762,
        "caveat": "selective activation checkpointing (recompute), eager; measured memory 82.4 GiB",
    },
    {
        "name": "Llama 3.1 8B, 128 H100, FSDP, local batch 2 (torchtitan table 3)",
        "source": TT,
        "config": "configs/llama3_8b.toml",
        "world": 128,
        "overrides": [*LLAMA_VOCAB, "--training.batch_size", "2"],
        "backends": ["fsdp2"],
        "metric": "tokens_per_s_per_device",
        "metric_label": TPS,
        "published": 5605,
        "caveat": "selective activation checkpointing, eager",
    },
    {
        "name": "Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, local batch 16 (torchtitan table 4)",
        "source": TT,
        "config": "configs/llama3_70b.toml",
        "world": 256,
        "overrides": ["--training.batch_size", "16"],
        "backends": ["fsdp2"],
        "metric": "tokens_per_s_per_device",
        "metric_label": TPS,
        "published": 829,
        "caveat": "full activation checkpointing (+1 forward), Float8 GEMMs, torch.compile",
    },
    {
        "name": "Llama 3.1 405B, 512 H100, FSDP 8 x TP 8 x PP 8, 1F1B (torchtitan table 5)",
        "source": TT,
        "config": "configs/llama3_405b.toml",
        "world": 512,
        "overrides": [
            "--model.n_layers",
            "128",
            "--parallelism.pp",
            "8",
            "--parallelism.pp_microbatches",
            "32",
            "--training.batch_size",
            "32",
        ],
        "backends": ["fsdp2"],
        "metric": "tokens_per_s_per_device",
        "metric_label": TPS,
        "published": 100,
        "caveat": "128 blocks here (pp 8 must divide them; 126 in Llama), full AC, Float8, "
        "async TP, compile",
    },
    {
        "name": "DeepSeek-V3-style 16B MoE, 8 H100 (flex_shard)",
        "source": "flex_shard's published figures",
        "config": "configs/moe.toml",
        "world": 8,
        "overrides": ["--model.vocab_size", "102400"],
        "backends": ["flexshard"],
        "metric": "tokens_per_s_per_device",
        "metric_label": TPS,
        "published": 9456,
        "caveat": "DeepSeek-V2-Lite-like shapes with GQA (not MLA); batch and seq as "
        "configs/moe.toml (2 x 4096): the published batch is not known here",
    },
    {
        "name": "same, exposed all-gather per step, flex_shard",
        "source": "flex_shard",
        "config": "configs/moe.toml",
        "world": 8,
        "overrides": ["--model.vocab_size", "102400"],
        "backends": ["flexshard"],
        "metric": "exposed_all_gather_s",
        "scale": 1e3,
        "metric_label": "exposed all-gather ms",
        "published": 30,
        "caveat": "flex_shard's own schedule may differ from flexshard's",
    },
    {
        "name": "same, exposed all-gather per step, FSDP2",
        "source": "flex_shard",
        "config": "configs/moe.toml",
        "world": 8,
        "overrides": ["--model.vocab_size", "102400"],
        "backends": ["fsdp2"],
        "metric": "exposed_all_gather_s",
        "scale": 1e3,
        "metric_label": "exposed all-gather ms",
        "published": 110,
        "caveat": "",
    },
]


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
