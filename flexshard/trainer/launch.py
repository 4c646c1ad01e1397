"""Command line: ``flexshard-train --nproc N --config configs/debug.toml [--training.steps 20]``
spawns N local ranks itself (gloo on CPU); under ``torchrun`` (``python -m
flexshard.trainer``) every process runs the job as torchrun describes it.

torch and the job's modules are imported inside the functions that run a job, so
``--help`` (every config key, from the schema) prints without them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .config import Config, ConfigError, config_from_dict, load_config

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

    import torch.multiprocessing as mp

    from .parallel.dims import ParallelDims


def leave_together() -> None:
    """Every rank done before any tears gloo down: a rank that exits while its peers
    still talk to it now and then aborts at exit ("terminate called without an active
    exception"; torch's own fully_shard alike)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def one_line(err: ConfigError) -> str:
    """The line ``flexshard-train`` prints for a problem with the job's input."""
    what = getattr(err, "what", "config error")
    return f"flexshard-train: {what}: {str(err).replace(chr(10), ' ')}"


def exit_on_config_error(err: ConfigError, say: bool) -> NoReturn:
    """Exit with status 1, printing the one line if ``say``. Under torchrun every rank
    also leaves it in its error file: the rank that fails first may be one that does not
    print, and torchrun stops the others before they can; its failure summary then names
    the first failure's line, whichever rank that is."""
    line = one_line(err)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # torch's own record format (ErrorHandler.record_exception), the line as the trace
        info = {"py_callstack": line, "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))
    sys.exit(line if say else 1)


def free_port() -> int:
    """A port free on 127.0.0.1 now, where the ranks meet (not reserved: the first rank
    binds it moments later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_local_rank(
    rank: int, fn: Callable[..., None], nproc: int, port: int, args: tuple[Any, ...]
) -> None:
    import torch

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # N ranks share this machine's cores: one thread each unless there are cores to spare
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    fn(rank, *args)


def spawn_local(
    fn: Callable[..., None],
    nproc: int,
    args: tuple[Any, ...] = (),
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> mp.ProcessContext | None:
    """Run ``fn(rank, *args)`` (a module-level function) on ``nproc`` local processes,
    each in the environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` on 127.0.0.1 at a free port, gloo
    on the loopback), the machine's cores shared between them: ``init_process_group``
    needs no other argument. The one local launcher of flexshard-train,
    flexshard-generate and the tests. ``join``: wait for all, raising the first failed
    rank's error (torch's ``ProcessException``); else return the started processes."""
    import torch.multiprocessing as mp

    port = free_port()
    return mp.start_processes(
        _as_local_rank,
        args=(fn, nproc, port, args),
        nprocs=nproc,
        join=join,
        daemon=daemon,
        start_method=start_method,
    )


def _rank_main(local_rank: int, table: dict, dims: ParallelDims, errors: SimpleQueue) -> None:
    """One spawned rank of the job; a ConfigError goes to the parent as its line
    (printed once there), not a traceback."""
    import torch.distributed as dist

    from .train import run

    try:
        run(config_from_dict(table), dims)
        leave_together()
    except ConfigError as err:
        errors.put(one_line(err))
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(cfg: Config, dims: ParallelDims, nproc: int) -> None:
    """Run the job on ``nproc`` local processes. A rank's ConfigError (a checkpoint that
    does not fit, a text too short) exits with its one line; any other failure raises
    the rank's traceback."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    errors = mp.get_context("spawn").SimpleQueue()
    # its "Terminating process ..." warning names the ranks stopped after the first
    # failure: a consequence, not the cause the line or traceback below gives
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        spawn_local(_rank_main, nproc, (cfg.to_dict(), dims, errors))
    except ProcessException:
        # the other ranks fail too once one leaves (their collectives break): the
        # ConfigError is the cause, whichever rank the join saw first
        if errors.empty():
            raise
        sys.exit(errors.get())


def _keys(section: Any, prefix: str) -> list[str]:
    """``[prefix] key=default, ...`` lines of a config section, its subsections after."""
    plain, nested = [], []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            nested += _keys(value, f"{prefix}.{f.name}")
        else:
            plain.append(f"{f.name}={value!r}")
    line = textwrap.fill(
        f"[{prefix}] " + ", ".join(plain), width=92, initial_indent="  ", subsequent_indent="    "
    )
    return [line, *nested]


def epilog() -> str:
    """What ``--help`` says after the options: every config key, resuming, the docs."""
    cfg = Config()
    sections = [
        line for f in dataclasses.fields(cfg) for line in _keys(getattr(cfg, f.name), f.name)
    ]
    return "\n".join(
        [
            "Config: a TOML file of these sections and keys (defaults shown); any key can",
            "be overridden on the command line: --training.steps 20 --parallelism.dp_shard 3",
            *sections,
            "",
            "Resuming: with --checkpoint.enable true, a checkpoint is saved every",
            "checkpoint.interval steps (and at the last) to <job.dump_folder>/<checkpoint.folder>/",
            "step-N. Running the same command again, e.g. with a larger --training.steps,",
            "resumes from the latest complete one (checkpoint.resume, on by default), the",
            "lr schedule then following the new training.steps;",
            "--checkpoint.resume false or another job.dump_folder starts afresh.",
            "",
            "Every section and key explained: docs/trainer.md",
        ]
    )


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="flexshard-train",
        description="Train a Llama-style model with flexshard (or torch FSDP2) data parallelism.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    import torch.distributed as dist

    from .checkpointing.preflight import check_before_start
    from .parallel.parallelize import checked_dims
    from .rl.grpo import check_rl
    from .train import run

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        cfg = load_config(args.config, overrides)
        if args.nproc is not None and args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: must be at least 1")
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc or 1
        dims = checked_dims(cfg, world_size)  # a layout that fits, or say so
        check_rl(cfg, dims)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun else world_size
        check_before_start(cfg, local)
    except ConfigError as err:
        # under torchrun every rank checks its machine; one line per machine is enough
        exit_on_config_error(err, not under_torchrun or os.environ.get("LOCAL_RANK", "0") == "0")
    if not under_torchrun:
        spawn(cfg, dims, args.nproc or 1)  # a plain `python -m flexshard.trainer`: one local rank
        return
    try:
        run(cfg, dims)
        leave_together()
    except ConfigError as err:  # the ranks meet the same input: rank 0 says it
        exit_on_config_error(err, os.environ["RANK"] == "0")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
