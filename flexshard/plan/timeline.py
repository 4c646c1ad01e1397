"""Activation bytes alive at each part of one microbatch's forward, loss and backward,
measured on a model of 2 blocks under ``FakeTensorMode`` (shapes only, no compute).

A ``TorchDispatchMode`` under the fake mode counts every storage an op makes until it
dies (as flexshard/testing/live_memory.py counts real ones), so what the trainer's own
``loss_fn`` keeps (an fp32 copy of the logits and its log-softmax, the fp32 gradients
at the start of backward) is counted as the trainer allocates it. Parameters are made
before counting starts, and each parameter's gradient is dropped once accumulated
(the runtime reduces it into the gathered-gradient buffer, which the plan counts
apart), so what is left are activations, temporaries and the loss's buffers.

Each part keeps its largest sum: forward of block 0 and 1; the head (final norm, LM
head and the loss, forward and backward, until the gradient reaches the last block);
backward of block 1 and 0. A model of L blocks then holds ``per_block`` more for
every further block below the one running (see :func:`activation_moments`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from flexshard.torch_internals import FakeTensorMode, TorchDispatchMode, tree_map_only
from flexshard.trainer.config import ModelConfig
from flexshard.trainer.models.layers import loss_fn  # the trainer's loss, as it runs it

from .activations import fake_model


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops made and that are still alive; the peak per ``phase``."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = 0
        self.phase = "before"
        self.peaks: dict[str, int] = {}
        # every storage's birth (+bytes) and death (-bytes), in order: (phase, id, bytes)
        self.events: list[tuple[str, int, int]] = []

    def ignore(self, tensors: Any) -> None:
        """Storages made before counting (parameters): a view of one is no new memory."""
        for t in tensors:
            self._sizes[t.untyped_storage()] = ([0], None)

    def _dead(self, size: list[int], _ref: Any) -> None:
        self.current -= size[0]
        self.events.append((self.phase, size[1], -size[0]))

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._sizes:
            return
        size = [storage.nbytes(), len(self.events)]  # a cell the death callback reads
        self._sizes[storage] = (size, weakref.ref(storage, partial(self._dead, size)))
        self.current += size[0]
        self.events.append((self.phase, size[1], size[0]))
        if self.current > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


Event = tuple[int, int]  # (storage id, +bytes made / -bytes freed)


@dataclass(frozen=True)
class StepTensors:
    """The storages behind the timeline, one by one, for the allocator
    (``flexshard/plan/allocator.py``): block 1's forward and backward stand for every
    block, the head's for the head. A storage a block's forward makes and does not free
    stays until that block's backward frees it (else until its end); one its backward
    makes and does not free (the gradient passed down) until the end of the next
    block's backward; one
    the head makes and does not free until the end of the first block's backward;
    ``prelude`` (the embedding's) until the end of backward. A free of a storage made
    in another part is left to these rules."""

    prelude: tuple[int, ...]
    forward: tuple[Event, ...]
    head: tuple[Event, ...]
    backward: tuple[Event, ...]

    def scaled(self, block: float, extra_per_block: int, head: float) -> StepTensors:
        def times(events: tuple[Event, ...], factor: float) -> tuple[Event, ...]:
            return tuple((key, round(size * factor)) for key, size in events)

        kept = ((-1, extra_per_block),) if extra_per_block else ()
        return StepTensors(
            self.prelude,
            times(self.forward, block) + kept,
            times(self.head, head),
            times(self.backward, block),
        )


def step_tensors(events: list[tuple[str, int, int]]) -> StepTensors:
    """Sort the recorded births and deaths (``_LiveBytes.events``) by part."""
    born = {key: phase for phase, key, size in events if size > 0}

    def part(phase: str, *made_in: str) -> tuple[Event, ...]:
        return tuple((k, n) for p, k, n in events if p == phase and born.get(k) in made_in)

    prelude = tuple(n for p, k, n in events if p == "before" and n > 0)
    # the backward frees what its forward kept as it goes
    backward = part("backward 1", "backward 1", "forward 1")
    return StepTensors(prelude, part("forward 1", "forward 1"), part("head", "head"), backward)


@dataclass(frozen=True)
class ActivationTimeline:
    """One microbatch's activation bytes (no parameters, no parameter gradients) at the
    largest moment of each part of the step, as ``blocks held * per_block + rest``:
    the rest is what the running block (or the head) has on top of the blocks whose
    saved activations are alive. Measured on 2 blocks, it holds for any number."""

    per_block: int  # what a block keeps from its forward to its backward
    forward_rest: int  # forward of block i: i blocks held + this
    head_rest: int  # final norm, LM head and the loss, forward and backward: L blocks + this
    backward_rest: int  # backward of block i: i + 1 blocks held + this
    tensors: StepTensors | None = None  # the storages, one by one (None: not recorded)

    def forward(self, i: int) -> int:
        return i * self.per_block + self.forward_rest

    def head(self, blocks: int) -> int:
        return blocks * self.per_block + self.head_rest

    def backward(self, i: int) -> int:
        return (i + 1) * self.per_block + self.backward_rest

    def scaled(
        self, block: float, extra_per_block: int = 0, head: float = 1.0
    ) -> ActivationTimeline:
        """The blocks' bytes times ``block`` (a tp rank's share), plus
        ``extra_per_block`` kept per block (TP collectives' outputs under op-level
        checkpointing); the head's own bytes (logits, loss) times ``head``."""
        return ActivationTimeline(
            per_block=round(self.per_block * block) + extra_per_block,
            forward_rest=round(self.forward_rest * block),
            head_rest=round(self.head_rest * head),
            backward_rest=round(self.backward_rest * block),
            tensors=self.tensors.scaled(block, extra_per_block, head) if self.tensors else None,
        )


def _mark_block(live: _LiveBytes, index: int):  # type: ignore[no-untyped-def]
    def pre(module: Any, args: Any) -> None:
        live.phase = f"forward {index}"

    def post(module: Any, args: Any, out: torch.Tensor) -> None:
        live.phase = "head"
        if out.requires_grad:  # the gradient reaching this block's output: its backward
            out.register_hook(lambda grad: setattr(live, "phase", f"backward {index}"))

    return pre, post


def measure_timeline(
    model: ModelConfig, batch: int, seq: int, dtype: torch.dtype, ac: str = "none"
) -> ActivationTimeline:
    """``ac``: "none", "full", "op" or "op_every_second_mm" (each block checkpointed
    that way: ``activations.fake_model``)."""
    with FakeTensorMode():
        net = fake_model(model, 2, dtype, ac)
        tokens = torch.randint(0, model.vocab_size, (batch, seq))
        for p in net.parameters():  # reduced by the runtime as it lands (counted apart)
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        live = _LiveBytes()
        cos, sin = net.rope(seq, tokens.device)  # cached before any step: no activation
        live.ignore([*net.parameters(), tokens, cos, sin])
        for i, block in enumerate(net.layers):
            pre, post = _mark_block(live, i)
            block.register_forward_pre_hook(pre)
            block.register_forward_hook(post)
        with live:
            loss_fn(net(tokens), tokens).backward()
    p = live.peaks
    per_block = p["forward 1"] - p["forward 0"]
    return ActivationTimeline(
        per_block=per_block,
        forward_rest=p["forward 0"],
        head_rest=p["head"] - 2 * per_block,
        backward_rest=max(p["backward 1"] - 2 * per_block, p.get("backward 0", 0) - per_block),
        tensors=step_tensors(live.events),
    )


@lru_cache(maxsize=64)
def _cached(key: str, batch: int, seq: int, dtype: torch.dtype, ac: str) -> ActivationTimeline:
    return measure_timeline(_MODELS[key], batch, seq, dtype, ac)


_MODELS: dict[str, ModelConfig] = {}


def timeline(
    model: ModelConfig, batch: int, seq: int, dtype: torch.dtype, ac: str
) -> ActivationTimeline:
    key = repr(model)
    _MODELS[key] = model
    return _cached(key, batch, seq, dtype, ac)


def mix(plain: ActivationTimeline, marked: ActivationTimeline, share: float) -> ActivationTimeline:
    """A model where ``share`` of the blocks are checkpointed: a block keeps the mean of
    the two; the running block's own bytes are the larger of the two; the storages one
    by one are those of the kind most blocks are."""
    if share in (0, 1):
        return marked if share else plain
    return ActivationTimeline(
        per_block=round(plain.per_block * (1 - share) + marked.per_block * share),
        forward_rest=max(plain.forward_rest, marked.forward_rest),
        head_rest=max(plain.head_rest, marked.head_rest),
        backward_rest=max(plain.backward_rest, marked.backward_rest),
        tensors=marked.tensors if share >= 0.5 else plain.tensors,
    )
