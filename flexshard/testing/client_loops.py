"""accelerate's and Lightning's own training loops over a transformers ``LlamaForCausalLM``,
with torch's FSDP2 or flexshard's ``fully_shard``, in one process of a gloo group (each
rank of ``run_distributed`` builds both libraries and can alternate them).

* **accelerate 1.15**: its FSDP2 plugin (``fsdp_version=2``, every ``LlamaDecoderLayer``
  wrapped) prepares the model, AdamW, a warm-up LR schedule and the dataloader; the loop
  is the one accelerate documents: ``with accelerator.accumulate(model)``, ``backward``,
  ``clip_grad_norm_`` on the syncing micro-batch, ``step``, ``zero_grad``. flexshard is
  swapped in where accelerate imports it (``torch.distributed.fsdp.fully_shard``, read
  inside ``fsdp2_prepare_model``). accelerate turns the plugin on for accelerator
  devices only; on CPU the state is set as it sets it there (``_use_fsdp2_plugin``).
* **Lightning 2.6**: ``Trainer.fit`` with ``ModelParallelStrategy`` (its FSDP2 path); the
  ``LightningModule`` applies ``fully_shard`` in ``configure_model`` as Lightning's FSDP2
  guide does, each decoder layer then the root, on ``device_mesh["data_parallel"]``, so
  the user's one changed import is the ``fully_shard`` that module calls. Gradient
  clipping, accumulation and the optimizer step are Lightning's. Each repetition is a new
  ``Trainer.fit`` (Lightning's loop runs to ``max_steps``), on the same module.

Per optimizer step a :class:`~flexshard.testing.collectives.StepRecord`: the micro-batch
losses, the collectives issued (when counting) or the CPU and wall time; or, given a
:class:`~flexshard.testing.call_profile.CallProfile`, the step's Python calls go into it.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from .call_profile import CallProfile
from .collectives import StepRecord, record_collectives

LIBRARIES = ("fsdp2", "flexshard")
CLIENTS = ("accelerate", "lightning")
SEED = 0
LR = 1e-3


@dataclass(frozen=True)
class LoopSetup:
    """One client loop to run: the client, precision, micro-batches per optimizer step and
    the model's size (``tiny`` for tests, ``bench`` for benchmarks)."""

    client: str
    bf16: bool = False
    accumulation: int = 1
    size: str = "tiny"

    def label(self) -> str:
        parts = [self.client, "bf16" if self.bf16 else "fp32"]
        if self.accumulation > 1:
            parts.append(f"accum {self.accumulation}")
        return ", ".join(parts)


#: (vocab, hidden, intermediate, layers, heads, kv heads, sequence, batch per rank)
SIZES = {
    "tiny": (64, 32, 64, 2, 4, 2, 16, 2),
    "bench": (1024, 256, 512, 4, 8, 4, 128, 4),
}


def llama(size: str) -> torch.nn.Module:
    """The same ``LlamaForCausalLM`` on every rank and for every library (seeded)."""
    import transformers

    vocab, hidden, inter, layers, heads, kv, seq, _ = SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
    )
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


def token_dataset(size: str, samples: int) -> torch.utils.data.TensorDataset:
    """Random token rows, the same on every rank (the clients' samplers split them)."""
    vocab, *_, seq, _ = SIZES[size]
    gen = torch.Generator().manual_seed(SEED + 1)
    return torch.utils.data.TensorDataset(torch.randint(0, vocab, (samples, seq), generator=gen))


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


@contextmanager
def _step_meter(record: StepRecord, count: bool, calls: CallProfile | None) -> Iterator[None]:
    """Profiles the Python calls inside (``calls``), or counts the collectives issued
    (``count``), else times it."""
    if calls is not None:
        with calls.step():
            yield
    elif count:
        with record_collectives() as log:
            yield
        record.collectives = Counter(log.names())
    else:
        c0, w0 = time.process_time(), time.perf_counter()
        yield
        record.cpu, record.wall = time.process_time() - c0, time.perf_counter() - w0


def _quiet() -> None:
    """The clients' start-up notes (Lightning's device summary, its few-batches hint,
    accelerate's plugin warnings) say nothing about the comparison."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="accelerate")


def _client_env(rank: int, world_size: int) -> None:
    """What a launcher (torchrun) would have set: both clients read it and, finding the
    process group already made, use it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


class Loop:
    """One library's training through one client; ``run`` trains ``steps`` more
    optimizer steps and returns their records."""

    model: torch.nn.Module

    def run(self, steps: int, count: bool, calls: CallProfile | None = None) -> list[StepRecord]:
        raise NotImplementedError

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole (a collective per DTensor)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.model.named_parameters():
            t = p.detach()
            out[name] = t.full_tensor() if isinstance(t, DTensor) else t.clone()
        return out


# accelerate


def _use_fsdp2_plugin(acc: Any, bf16: bool) -> None:
    """accelerate sets ``distributed_type = FSDP`` for accelerator devices only (its
    state.py: MULTI_GPU and the like, not MULTI_CPU): set it on CPU as it does there,
    before each ``prepare``, for both libraries alike."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    if bf16:
        plugin.set_mixed_precision("bf16")
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2


def accelerator(rank: int, world_size: int, setup: LoopSetup) -> Any:
    """The process's one ``Accelerator`` (accelerate keeps its state per process)."""
    _client_env(rank, world_size)
    _quiet()
    from accelerate import Accelerator

    return Accelerator(
        mixed_precision="bf16" if setup.bf16 else "no",
        cpu=True,
        gradient_accumulation_steps=setup.accumulation,
    )


class AccelerateLoop(Loop):
    def __init__(self, acc: Any, setup: LoopSetup, library: str, samples: int) -> None:
        import flexshard

        self.acc, self.setup, self.library = acc, setup, library
        model = llama(setup.size)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
        batch = SIZES[setup.size][-1]
        loader = torch.utils.data.DataLoader(token_dataset(setup.size, samples), batch_size=batch)
        _use_fsdp2_plugin(acc, setup.bf16)
        swap = mock.patch.object(torch.distributed.fsdp, "fully_shard", flexshard.fully_shard)
        with swap if library == "flexshard" else ExitStack():
            self.model, self.opt, self.sched, loader = acc.prepare(model, opt, sched, loader)
        if library == "flexshard":
            assert isinstance(self.model, flexshard.FlexShardModule), type(self.model).__mro__
        self.batches = iter(loader)

    def run(self, steps: int, count: bool, calls: CallProfile | None = None) -> list[StepRecord]:
        acc, records = self.acc, []
        for _ in range(steps):
            record = StepRecord(loss=[])
            with _step_meter(record, count, calls):
                for _ in range(self.setup.accumulation):
                    (ids,) = next(self.batches)
                    with acc.accumulate(self.model):
                        loss = self.model(input_ids=ids, labels=ids).loss
                        acc.backward(loss)
                        if acc.sync_gradients:
                            acc.clip_grad_norm_(self.model.parameters(), 1.0)
                        self.opt.step()
                        self.sched.step()
                        self.opt.zero_grad()
                    record.loss.append(loss.detach().float().item())
            records.append(record)
        dist.barrier()
        return records


# Lightning


def _lightning_module(fully_shard: Callable, setup: LoopSetup) -> Any:
    import lightning as L

    class LitLlama(L.LightningModule):
        """A user's module as Lightning's FSDP2 guide writes it: ``fully_shard`` applied
        in ``configure_model``, each decoder layer, then the root."""

        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy

            model = llama(setup.size)
            mesh = self.device_mesh["data_parallel"]
            policy = (
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if setup.bf16
                else MixedPrecisionPolicy()
            )
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            self.model = model

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.detach().float().item())
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=LR)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LitLlama()


def _meter_callback(
    setup: LoopSetup, count: bool, calls: CallProfile | None, records: list[StepRecord]
) -> Any:
    import lightning as L

    class StepMeter(L.Callback):
        """One record per optimizer step: from the first micro-batch's start to the
        last's end (the step, clipping and zeroing are inside, done by Lightning)."""

        def __init__(self) -> None:
            self.stack = ExitStack()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            if idx % setup.accumulation == 0:
                records.append(StepRecord(loss=[]))
                self.stack.enter_context(_step_meter(records[-1], count, calls))

        def on_train_batch_end(
            self, trainer: Any, module: Any, out: Any, batch: Any, idx: int
        ) -> None:
            if (idx + 1) % setup.accumulation == 0:
                self.stack.close()
                records[-1].loss = module.losses[-setup.accumulation :]

    return StepMeter()


class LightningLoop(Loop):
    def __init__(self, rank: int, world_size: int, setup: LoopSetup, library: str, samples: int):
        import flexshard

        _client_env(rank, world_size)
        _quiet()
        self.world_size, self.setup = world_size, setup
        shard = (
            flexshard.fully_shard if library == "flexshard" else torch.distributed.fsdp.fully_shard
        )
        self.module = _lightning_module(shard, setup)
        self.samples = samples

    @property
    def model(self) -> torch.nn.Module:  # type: ignore[override]
        return self.module.model

    def run(self, steps: int, count: bool, calls: CallProfile | None = None) -> list[StepRecord]:
        import lightning as L
        from lightning.pytorch.strategies import ModelParallelStrategy

        records: list[StepRecord] = []
        trainer = L.Trainer(
            accelerator="cpu",
            devices=self.world_size,
            strategy=ModelParallelStrategy(
                data_parallel_size=self.world_size, tensor_parallel_size=1
            ),
            max_steps=steps,
            accumulate_grad_batches=self.setup.accumulation,
            gradient_clip_val=1.0,
            callbacks=[_meter_callback(self.setup, count, calls, records)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        batch = SIZES[self.setup.size][-1]
        data = token_dataset(self.setup.size, self.samples)
        trainer.fit(self.module, torch.utils.data.DataLoader(data, batch_size=batch))
        dist.barrier()
        return records


def build_loop(
    rank: int, world_size: int, setup: LoopSetup, library: str, steps: int, acc: Any = None
) -> Loop:
    """``library``'s loop through ``setup.client``, with data for ``steps`` optimizer steps
    (``acc``: the process's Accelerator, for accelerate)."""
    batch = SIZES[setup.size][-1]
    samples = steps * setup.accumulation * batch * world_size
    if setup.client == "accelerate":
        return AccelerateLoop(acc, setup, library, samples)
    if setup.client == "lightning":
        return LightningLoop(rank, world_size, setup, library, samples)
    raise ValueError(f"client {setup.client!r}: one of {CLIENTS}")
