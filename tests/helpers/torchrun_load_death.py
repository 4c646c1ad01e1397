"""A checkpoint load as torchrun runs it, with one rank dying mid-load: the worker of
global rank ``VICTIM`` exits without a word when it is about to read its chunks
(``PHASE=read``, the default) or to check the manifest it was sent, before the read
(``PHASE=check``); every other worker writes what its load raised (type, message, seconds) to
``RESULTS/rank<r>.json``. Usage: ``torchrun ... torchrun_load_death.py CHECKPOINT RESULTS``."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.checkpoint import io, verified_read
from flexshard.testing import TinyTransformer, TransformerConfig

TIMEOUT = datetime.timedelta(seconds=60)


def _die(*args: object, **kwargs: object) -> None:
    os._exit(3)


def main(checkpoint: str, results: Path) -> None:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    if rank == int(os.environ["VICTIM"]):
        if os.environ.get("PHASE", "read") == "check":
            io.parse_manifest = _die
        else:
            verified_read.VerifyingReader.read_chunks = _die
    torch.manual_seed(1)
    model = TinyTransformer(TransformerConfig())
    fs.flex_shard(model, mesh=dist.group.WORLD, buckets=[fs.BucketSpec("*", placement=fs.Shard(0))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    started = time.monotonic()
    outcome: dict[str, object] = {"type": None}
    try:
        fs.checkpoint.load(checkpoint, model, optimizer, timeout=TIMEOUT)
    except Exception as err:
        outcome = {"type": type(err).__name__, "error": str(err)}
    outcome["seconds"] = time.monotonic() - started
    (results / f"rank{rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
