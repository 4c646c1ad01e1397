"""Command line: ``flexshard-train --nproc N --config configs/debug.toml [--training.steps 20]``
spawns N local ranks itself (gloo on CPU); under ``torchrun`` (``python -m
flexshard.trainer``) every process runs the job as torchrun describes it."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.utils.distributed import get_free_port

from .config import Config, ConfigError, config_from_dict, load_config
from .parallel import ParallelDims
from .train import run


def _rank_main(local_rank: int, nproc: int, port: int, table: dict) -> None:
    """One spawned rank: the environment torchrun would give it, then the job."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # N ranks share this machine's cores: one thread each unless there are cores to spare
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        run(config_from_dict(table))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(cfg: Config, nproc: int) -> None:
    """Run the job on ``nproc`` local processes; a failing rank's traceback is raised."""
    mp.spawn(_rank_main, args=(nproc, get_free_port(), cfg.to_dict()), nprocs=nproc, join=True)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="flexshard-train",
        description="Train a Llama-style model with flexshard (or torch FSDP2) data parallelism.",
        epilog="Any config key can be overridden: --training.steps 20 --parallelism.dp_shard 3",
    )
    parser.add_argument("--config", help="TOML config file (configs/debug.toml, ...)")
    parser.add_argument(
        "--nproc",
        type=int,
        help="spawn this many local ranks (CPU: gloo); leave out under torchrun",
    )
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if args.nproc is not None and args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: must be at least 1")
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc or 1
        ParallelDims.from_config(cfg.parallelism, world_size)  # a layout that fits, or say so
    except ConfigError as err:
        sys.exit(f"flexshard-train: config error: {err}")
    if args.nproc is not None and not under_torchrun:
        spawn(cfg, args.nproc)
    elif under_torchrun:
        try:
            run(cfg)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    else:
        spawn(cfg, 1)  # a plain `python -m flexshard.trainer`: one local rank


if __name__ == "__main__":
    main()
