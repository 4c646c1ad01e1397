"""Qwen3.5's Gated DeltaNet layers under context parallelism: per rank and step, the
bytes their CP exchanges send, the tokens the chunked delta rule runs on, and the
rule's forward FLOPs (torch's FlopCounterMode). Counts, not times: the same on a
loaded machine.

    .venv/bin/python -m benchmarks.deltanet_cp_counts --seq 512 528

A 4-layer model (3 Gated DeltaNet layers: 2 key heads of 12, 4 value heads of 10, a
3-tap conv; dim 32), batch 2, cp 2 on the first sequence length and cp 3 on the
second; the step measured is the second.
"""

from __future__ import annotations

import argparse
import tempfile
from unittest import mock

import torch

from flexshard.testing import run_distributed

MODEL = {
    "dim": 32,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden": 34,
    "attention": "gated",
    "qk_norm": True,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_attention": {
        "conv_kernel": 3,
        "key_head_dim": 12,
        "value_head_dim": 10,
        "num_key_heads": 2,
        "num_value_heads": 4,
    },
}


def _counts(rank: int, world: int, folder: str, seq: int) -> dict[str, int]:
    from torch.utils.flop_counter import FlopCounterMode

    from flexshard.trainer.config import config_from_dict
    from flexshard.trainer.models import linear_attention
    from flexshard.trainer.parallel.exchange import exchange_bytes
    from flexshard.trainer.train import setup, train_step

    job = setup(
        config_from_dict(
            {
                "model": MODEL,
                "parallelism": {"dp_shard": 1, "cp": world},
                "training": {"steps": 2, "seq_len": seq, "batch_size": 2, "seed": 3},
                "job": {"dump_folder": folder, "progress": False, "plot": False},
            }
        )
    )
    tokens, flops = [0], [0]
    rule = linear_attention._chunked_rule

    def counted(q: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        tokens[0] += q.shape[0] * q.shape[2]
        with FlopCounterMode(display=False) as counter:
            out = rule(q, *args)
        flops[0] += counter.get_total_flops()
        return out

    layers = [m for m in job.model.modules() if isinstance(m, linear_attention.GatedDeltaNet)]
    train_step(job, 0)
    exchange_bytes(layers)  # from zero
    with mock.patch.object(linear_attention, "_chunked_rule", counted):
        train_step(job, 1)
    sent = exchange_bytes(layers).get("cp", 0)
    return {"cp_bytes_sent": sent, "rule_tokens": tokens[0], "rule_forward_flops": flops[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs=2, default=[512, 528], help="cp 2, cp 3")
    args = parser.parse_args()
    for world, seq in zip((2, 3), args.seq):
        with tempfile.TemporaryDirectory() as folder:
            counts = run_distributed(_counts, world, folder, seq, timeout=600)[0]
        print(f"cp {world}, seq {seq}, batch 2, 3 Gated DeltaNet layers, per rank: {counts}")


if __name__ == "__main__":
    main()
