"""torchtitan 0.3.0's own ``Trainer`` on CPU gloo, with FSDP2 or flexshard's
``fully_shard`` swapped in at torchtitan's one import site (``torchtitan.distributed.fsdp``,
where ``apply_fsdp_to_decoder`` of llama3, qwen3 (dense and MoE) and deepseek_v3 finds
it), as a user who changes one import would. The Trainer is built from torchtitan's config registry
(``llama3_debugmodel()`` ...) and runs its own ``train()`` loop: its ``ChunkedLossWrapper``
(the LM head per chunk with its own backward, ``set_requires_gradient_sync(False,
recurse=False)`` on the lm_head FSDP module), ``default_adamw``, LR scheduler, clipping,
gradient accumulation and metrics, untouched. Each rank of ``run_distributed`` builds
its Trainer in process (torchtitan skips its own ``init_process_group`` when one exists).

What differs from a GPU run, all listed in ``Harness.changes``:

* the CPU patches of ``torchtitan_cpu.apply_cpu_patches`` (device_type, FlexAttention
  as causal SDPA, the ``datasets`` stub), plus ``device_module``: torchtitan calls
  ``torch.cuda`` through it (``set_device``, its memory monitor); a CPU stand-in answers;
* ``set_pg_timeouts`` (after the first step) keeps its barrier and skips the timeouts:
  it calls ``torch.distributed.set_timeout``, which torch 2.13 does not have;
* gloo has no ``PREMUL_SUM``: ``set_force_sum_reduction_for_comms(True)`` on every FSDP
  module, right after torchtitan's ``parallelize_fn`` (wrapped), for both libraries;
* no network: a tokenizer built with ``tokenizers`` into a folder given as
  ``hf_assets_path``, and :class:`SyntheticTextDataLoader` (a ``ParallelAwareDataloader``
  plugged in through ``config.dataloader``, torchtitan's own extension point) whose
  documents are random words through that tokenizer, one document per sequence (so
  the attention mask is causal, which the SDPA patch covers);
* config, not patches: small ``seq_len`` / ``local_batch_size``, CUDA graphs off,
  checkpointing and validation off, a fixed seed, ``mixed_precision_param`` set (its
  default is bf16), ``spmd_backend = "full_dtensor"`` (the default ``"spmd_types"``
  hands FSDP2 plain parameters with ``dp_mesh_dims``, which torch 2.13 refuses).
  Activation checkpointing (the debug configs' ``SelectiveAC``) stays on: it runs on CPU.

Per step, :func:`measure_steps` wraps the Trainer's ``train_step`` to record the
collectives each step issues (``collectives.record_collectives``) and its CPU and
wall time (not while recording: the log's wrappers cost time); it runs the Trainer's
``train()`` for that many steps (without the 2 s sleep ``train()`` ends with).

The loss torchtitan logs under ``full_dtensor`` comes out W times the mean token loss (its
``dist_sum`` adds up a loss that is already global); both libraries alike.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from .call_profile import CallProfile
from .collectives import StepRecord, record_collectives
from .torchtitan_cpu import apply_cpu_patches

LIBRARIES = ("fsdp2", "flexshard")
#: torchtitan's debug models, each by its config registry's function
MODELS = {
    "llama3": ("torchtitan.models.llama3.config_registry", "llama3_debugmodel"),
    "qwen3": ("torchtitan.models.qwen3.config_registry", "qwen3_debugmodel"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3.config_registry", "deepseek_v3_debugmodel"),
    "qwen3_moe": ("torchtitan.models.qwen3.config_registry", "qwen3_moe_debug"),
}
SEQ = 64  # divisible by ChunkedLossWrapper's 8 chunks
BATCH = 2
SEED = 0


# the CPU stand-in for torch.cuda where torchtitan calls it through ``device_module``
class _CpuDeviceModule:
    """What torchtitan calls on ``device_module`` (``set_device``, ``device_count``,
    its ``DeviceMemoryMonitor``), answered for the CPU; anything else: ``torch.cpu``'s."""

    @staticmethod
    def set_device(_device: Any) -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(_device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(_device: Any = None) -> Any:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return type("CpuProperties", (), {"total_memory": pages})()

    @staticmethod
    def memory_stats(_device: Any = None) -> dict:
        return {}  # torchtitan reads each stat with a default

    @staticmethod
    def reset_peak_memory_stats(_device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


CPU_DEVICE_MODULE = _CpuDeviceModule()


_APPLIED: list[str] = []  # what this process has patched, for every Harness to list


def apply_trainer_cpu_patches() -> list[str]:
    """``apply_cpu_patches``, then the CPU stand-in for ``device_module`` (and "cpu" for
    ``device_type``) in every torchtitan module that bound them by name, and
    ``set_pg_timeouts`` without what this torch lacks; everything patched in this
    process (checked: a torchtitan that moved these fails here, not with a CUDA error)."""
    import importlib
    import sys

    _APPLIED.extend(p for p in apply_cpu_patches() if p not in _APPLIED)
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    import torchtitan.trainer  # noqa: F401  (loads the modules that bind them)

    for module_name, _ in MODELS.values():
        importlib.import_module(module_name)
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = CPU_DEVICE_MODULE
            _APPLIED.append(f"{name}.device_module = a CPU stand-in")
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            _APPLIED.append(f"{name}.device_type = 'cpu'")
    assert tt_utils.device_module is CPU_DEVICE_MODULE
    if not hasattr(dist, "set_timeout") and dist_utils.set_pg_timeouts is not _barrier_only:
        dist_utils.set_pg_timeouts = _barrier_only
        _APPLIED.append(
            "set_pg_timeouts: its barrier only (torch.distributed.set_timeout: newer torch)"
        )
    os.environ.setdefault("LOCAL_RANK", "0")  # get_local_device reads it; the CPU has one
    return list(_APPLIED)


def _barrier_only(timeout: Any, parallel_dims: Any) -> None:
    """torchtitan's ``set_pg_timeouts`` (after the first step) without what this torch
    lacks: the barrier it starts with, not the shorter timeouts."""
    dist.barrier()


# no network: a tokenizer and a data set made here
def word(i: int) -> str:
    return f"w{i}"


def write_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level ``tokenizer.json`` of ``vocab_size`` ids (words ``w0`` ..., unk,
    bos, eos) and its ``tokenizer_config.json``, in ``folder`` (the Trainer's
    ``hf_assets_path``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<bos>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({word(i): len(specials) + i for i in range(vocab_size - len(specials))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class SyntheticTextDataset(torch.utils.data.IterableDataset):
    """Documents of random words (seeded per data-parallel rank), encoded by the
    Trainer's tokenizer with BOS and EOS; one document fills one sequence exactly, so
    positions run 0..seq_len-1 and the attention mask is causal."""

    def __init__(self, tokenizer: Any, seq_len: int, dp_rank: int, words: int) -> None:
        self.tokenizer, self.seq_len, self.dp_rank, self.words = tokenizer, seq_len, dp_rank, words
        self.sample = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            rng = random.Random(f"{SEED}:{self.dp_rank}:{self.sample}")
            text = " ".join(word(rng.randrange(self.words)) for _ in range(self.seq_len - 1))
            ids = self.tokenizer.encode(text, add_bos=True, add_eos=True)
            assert len(ids) == self.seq_len + 1, len(ids)
            self.sample += 1
            tokens = torch.tensor(ids, dtype=torch.long)
            positions = torch.arange(self.seq_len)
            yield {"input": tokens[:-1], "positions": positions}, tokens[1:]

    def state_dict(self) -> dict[str, int]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample = state["sample"]


def _dataloader_class() -> type:
    """:class:`SyntheticTextDataLoader`, made when torchtitan is imported (lazily: this
    module imports without torchtitan)."""
    global SyntheticTextDataLoader
    if SyntheticTextDataLoader is not None:
        return SyntheticTextDataLoader
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class _Loader(ParallelAwareDataloader):
        """torchtitan's data-parallel loader over :class:`SyntheticTextDataset`."""

        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            dataset: str = "synthetic"
            words: int = 1000  # word ids drawn from w0..w{words-1}

        def __init__(
            self,
            config: Config,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            snapshot_every_n_steps: int | None = 1,
            **_: Any,
        ) -> None:
            dataset = SyntheticTextDataset(tokenizer, seq_len, dp_rank, config.words)
            super().__init__(
                dataset,
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                batch_size=local_batch_size,
                snapshot_every_n_steps=snapshot_every_n_steps,
            )

    _Loader.__name__ = _Loader.__qualname__ = "SyntheticTextDataLoader"
    SyntheticTextDataLoader = _Loader
    return _Loader


SyntheticTextDataLoader: type | None = None


# the Trainer
@dataclass(frozen=True)
class Setup:
    """One Trainer configuration (besides W): the model, precision, accumulation."""

    model: str = "llama3"
    bf16: bool = False
    #: microbatches per optimizer step (``global_batch_size`` = this * local * W)
    accumulation: int = 1
    #: ``training.steps``: what torchtitan's LR schedule is built for
    steps: int = 3
    #: the debug configs' ``SelectiveAC``; off: no activation checkpointing
    activation_checkpoint: bool = True
    #: ``parallelism.expert_parallel_degree`` (the MoE models' experts over that many ranks)
    expert_parallel: int = 1

    def label(self) -> str:
        parts = [self.model, "bf16" if self.bf16 else "fp32"]
        if self.accumulation > 1:
            parts.append(f"accum {self.accumulation}")
        if not self.activation_checkpoint:
            parts.append("no AC")
        if self.expert_parallel > 1:
            parts.append(f"EP {self.expert_parallel}")
        return ", ".join(parts)


def trainer_config(setup: Setup, world_size: int, assets: Path, dump: Path) -> Any:
    """torchtitan's registry config for ``setup.model``, made small and offline."""
    import importlib

    module, fn = MODELS[setup.model]
    config = getattr(importlib.import_module(module), fn)()
    from torchtitan.models.common.config_utils import decoder_vocab_size

    vocab = decoder_vocab_size(config.model_spec)
    write_tokenizer(assets, vocab)
    config.hf_assets_path = str(assets)
    config.dump_folder = str(dump)
    config.dataloader = _dataloader_class().Config(words=vocab - 3)
    training = config.training
    training.seq_len, training.local_batch_size, training.steps = SEQ, BATCH, setup.steps
    training.global_batch_size = BATCH * world_size * setup.accumulation
    training.mixed_precision_param = "bfloat16" if setup.bf16 else "float32"
    training.disable_cuda_graphs = True  # CUDA graphs: CUDA only
    config.parallelism.data_parallel_shard_degree = -1  # every rank
    config.parallelism.expert_parallel_degree = setup.expert_parallel
    # the default "spmd_types" hands fully_shard plain parameters with dp_mesh_dims,
    # which torch 2.13's FSDP2 refuses; "full_dtensor" is torchtitan's DTensor path
    config.parallelism.spmd_backend = "full_dtensor"
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.enable_tensorboard = False
    config.debug.seed = SEED
    if not setup.activation_checkpoint:
        config.activation_checkpoint = None
    return config


@contextmanager
def library_swapped(library: str) -> Iterator[None]:
    """``fully_shard`` at torchtitan's import site: FSDP2's (as imported) or flexshard's."""
    import torchtitan.distributed.fsdp as tt_fsdp

    if library not in LIBRARIES:
        raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
    if library == "fsdp2":
        yield
        return
    import flexshard as fs

    with mock.patch.object(tt_fsdp, "fully_shard", fs.fully_shard):
        yield


def _force_sum(parallelize_fn: Callable) -> Callable:
    """torchtitan's ``parallelize_fn``, then SUM for PREMUL_SUM(1) on gloo."""

    def parallelize(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert sharded, "torchtitan applied no fully_shard"
        for m in sharded:
            m.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


@dataclass
class Harness:
    """A built Trainer, what was changed to run it here, and the loss its metrics
    logged last (the global average loss torchtitan prints)."""

    trainer: Any
    library: str
    setup: Setup
    changes: list[str]
    folder: tempfile.TemporaryDirectory
    last_loss: float | None = None

    def close(self) -> None:
        self.trainer.close()
        self.folder.cleanup()


def build_trainer(setup: Setup, library: str, world_size: int) -> Harness:
    """torchtitan's Trainer for ``setup`` with ``library``'s ``fully_shard``; each rank
    calls it (inside ``run_distributed``)."""
    changes = apply_trainer_cpu_patches()
    changes += [
        "FSDP modules: set_force_sum_reduction_for_comms(True) after parallelize_fn",
        "hf_assets_path: a synthetic word-level tokenizer",
        "dataloader: SyntheticTextDataLoader (random words, one document per sequence)",
    ]
    folder = tempfile.TemporaryDirectory(prefix="flexshard_torchtitan_")
    root = Path(folder.name)
    config = trainer_config(setup, world_size, root / "assets", root / "dump")
    config.model_spec.parallelize_fn = _force_sum(config.model_spec.parallelize_fn)
    from torchtitan.trainer import Trainer

    with library_swapped(library):
        trainer = Trainer(config)
    harness = Harness(trainer, library, setup, changes, folder)
    metrics = trainer.metrics_processor
    log = metrics.log

    def keep_loss(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        harness.last_loss = float(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    metrics.log = keep_loss
    return harness


# measuring
def measure_steps(
    harness: Harness, steps: int, count: bool, calls: CallProfile | None = None
) -> list[StepRecord]:
    """Run ``steps`` more optimizer steps through the Trainer's own ``train()`` loop;
    per step its record: its loss, and its collectives if ``count``, else its CPU and
    wall time (the collective log's wrappers would cost time); with ``calls``, the
    step's Python calls go into that profile instead."""
    trainer = harness.trainer
    records: list[StepRecord] = []
    inner = trainer.train_step

    def train_step(data_iterator: Any) -> None:
        record = StepRecord()
        if calls is not None:
            with calls.step():
                inner(data_iterator)
        elif count:
            with record_collectives() as log:
                inner(data_iterator)
            record.collectives = Counter(log.names())
        else:
            c0, w0 = time.process_time(), time.perf_counter()
            inner(data_iterator)
            record.cpu, record.wall = time.process_time() - c0, time.perf_counter() - w0
        record.loss = harness.last_loss
        records.append(record)

    # the LR schedule was built for the steps set at build; this only ends train()
    trainer.config.training.steps = trainer.step + steps
    trainer.train_step = train_step  # on the instance, for this call only
    try:
        import torchtitan.trainer as tt_trainer

        # train() ends with 2 s of sleep on rank 0: not in its module's view of time
        # (only there: a watchdog thread's sleep must stay a sleep)
        with mock.patch.object(tt_trainer, "time", _TIME_WITHOUT_SLEEP):
            trainer.train()
    finally:
        del trainer.train_step
    dist.barrier()  # no rank starts its next steps before all have finished these
    return records


class _TimeWithoutSleep:
    """The ``time`` module, but ``sleep`` returns at once."""

    @staticmethod
    def sleep(_seconds: float) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


_TIME_WITHOUT_SLEEP = _TimeWithoutSleep()


def full_weights(harness: Harness) -> dict[str, torch.Tensor]:
    """Every parameter of the Trainer's model, whole (a collective per DTensor)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in harness.trainer.model_parts[0].named_parameters():
        t = p.detach()
        out[name] = t.full_tensor() if isinstance(t, DTensor) else t.clone()
    return out
