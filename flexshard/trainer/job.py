"""What the training loop needs, set up once by ``train.setup``: its own module, so the
pieces the loop calls (checkpointing, hf_checkpoint) name the type without importing
train.py, which imports them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .config_schema import Config
from .data import DPSampler, ValidationBatches
from .parallel import Meshes, ParallelDims
from .parallelize import Parallelized
from .tokenizer import Tokenizer


@dataclass
class Job:
    """What the loop needs, set up once."""

    cfg: Config
    device: torch.device
    rank: int
    dims: ParallelDims
    dp_rank: int
    model: nn.Module  # the first (often only) stage module
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler  # stepped after every optimizer step; in the checkpoints
    sampler: DPSampler
    folder: Path
    meshes: Meshes
    parallel: Parallelized  # every stage module this rank runs, and the pipeline runner
    tokenizer: Tokenizer | None = None
    validation: ValidationBatches | None = None  # the held-out batches, when enabled
    checkpointer: Any = None  # the background saver (checkpoint.async_mode), once made
