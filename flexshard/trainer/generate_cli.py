"""Text out: ``flexshard-generate --checkpoint <hf folder | dcp step folder> --prompt "..."``
(greedy with ``--temperature 0``, else sampled with ``--top-k``), with a KV cache: the
prompt runs once, then one token per forward.

One process holds the whole model; with ``--nproc N`` (or under ``torchrun``) the model
is sharded over the ranks by the trainer's ``parallelize`` with the default parallelism
(flexshard, Shard(0) buckets: one per block and the outer one), every rank reads only
its regions of the checkpoint, and each bucket is gathered for its part of a forward
and freed after it, by the same hooks as in training. Rank 0's token is the one every
rank takes.

A Hugging Face folder brings its config.json and tokenizer; a DCP checkpoint of the
trainer (``checkpoint/step-N``) needs the run's ``--config`` for the model's sizes."""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="flexshard-generate",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, help="HF folder or DCP step folder")
    parser.add_argument("--config", help="the run's TOML (DCP checkpoints only)")
    parser.add_argument("--prompt", default="", help="text to continue (empty: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: the whole vocabulary")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--nproc", type=int, help="shard the model over this many local ranks (gloo)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # torch and the model only now: --help prints without them
    from .generate import run_command

    run_command(args)


if __name__ == "__main__":
    main()
