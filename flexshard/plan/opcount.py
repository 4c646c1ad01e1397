"""What a step's eager compute does besides its GEMMs, counted from the ops torch
dispatches under ``FakeTensorMode`` (shapes only): how many aten ops run (each costs
the dispatcher and, in backward, the autograd engine), and how many bytes the
non-GEMM ones read and write (elementwise, norms, softmax, loss, casts, copies).

A ``TorchDispatchMode`` sees every op as the eager step issues it, like torch's
``RuntimeEstimator`` (``torch.distributed._tools.runtime_estimator``), whose roofline
mode needs CUDA; the bytes are torch's own count (``get_num_bytes`` of inputs and
outputs), GEMMs and attention are left to the FLOP count of ``steptime.bucket_flops``.
The model is measured as a dense block of 1 and of 2 layers (as ``activations``), so
the difference is one block and the rest the embedding / final norm / LM head / loss.
The optimizer step (with the trainer's gradient clipping) is counted on fake tensors
of one rank's shard sizes. ``oprecord`` records the same ops with their shapes, which
the CPU profile's calibration replays to fit the seconds per op and the bandwidth
these bytes move at (``flexshard.plan.calibration``)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from flexshard.torch_internals import (
    IGNORE_OPS,
    FakeTensorMode,
    TorchDispatchMode,
    get_num_bytes,
    tree_leaves,
)
from flexshard.trainer.config import Config, ModelConfig, TrainingConfig
from flexshard.trainer.models.model import Transformer

from .activations import dense_equivalent

aten = torch.ops.aten
#: causal flash attention on CPU, forward and backward (timed at its own rate)
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}
#: compute-bound ops, timed from FLOPs elsewhere (CPU flash attention is not in
#: torch's flop registry under its CPU name)
FLOP_OPS = set(flop_registry) | CPU_ATTENTION


@dataclass(frozen=True)
class OpCount:
    ops: int = 0  # aten ops dispatched (views included: they cost the dispatcher too)
    bytes: int = 0  # read + written by the ops that are neither views nor GEMMs

    def __add__(self, other: OpCount) -> OpCount:
        return OpCount(self.ops + other.ops, self.bytes + other.bytes)

    def __sub__(self, other: OpCount) -> OpCount:
        return OpCount(self.ops - other.ops, self.bytes - other.bytes)

    def scaled(self, factor: float) -> OpCount:
        return OpCount(self.ops, int(self.bytes * factor))


class OpCounter(TorchDispatchMode):
    """Counts ops and non-GEMM bytes; ``phase`` names the bin they go to."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, OpCount] = {}
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # FakeTensorMode's own queries (prim.device)
            return out
        moved = non_gemm_bytes(func, args, kwargs, out)
        self.counts[self.phase] = self.counts.get(self.phase, OpCount()) + OpCount(1, moved)
        return out


def non_gemm_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """Bytes the op ``func`` reads and writes (its tensor arguments and outputs, as
    torch's runtime estimator counts them); 0 for views, creations and the ops timed
    from their FLOPs."""
    packet = func.overloadpacket
    if packet in IGNORE_OPS or packet in FLOP_OPS:
        return 0
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    return sum(get_num_bytes(t) for t in tensors)


def count_ops(fn: Callable[[OpCounter], None]) -> dict[str, OpCount]:
    """Run ``fn(counter)`` under ``FakeTensorMode`` with the counter active (the
    function builds its own tensors there and may switch ``counter.phase``)."""
    counter = OpCounter()
    with FakeTensorMode():
        with counter:
            fn(counter)
    return counter.counts


@dataclass(frozen=True)
class ModelOps:
    block_forward: OpCount
    block_backward: OpCount
    head_forward: OpCount  # embedding, final norm, LM head, loss
    head_backward: OpCount


def _model_ops(model: ModelConfig, layers: int, batch: int, seq: int, dtype: torch.dtype):
    cfg = copy.deepcopy(model)
    cfg.n_layers = layers

    def step(counter: OpCounter) -> None:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            counter.phase = "setup"
            net = Transformer(cfg)
        finally:
            torch.set_default_dtype(previous)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
        counter.phase = "forward"
        logits = net(tokens)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), tokens.reshape(-1)
        )
        counter.phase = "backward"
        loss.backward()

    return count_ops(step)


@lru_cache(maxsize=32)
def _cached_model_ops(key: str, batch: int, seq: int, dtype: torch.dtype) -> ModelOps:
    model = _MODELS[key]
    one, two = (_model_ops(model, n, batch, seq, dtype) for n in (1, 2))
    block_f = two["forward"] - one["forward"]
    block_b = two["backward"] - one["backward"]
    return ModelOps(block_f, block_b, one["forward"] - block_f, one["backward"] - block_b)


_MODELS: dict[str, ModelConfig] = {}


def model_ops(cfg: Config, microbatch: int) -> ModelOps:
    """One data-parallel rank's non-GEMM work for a microbatch of ``microbatch``
    sequences (MoE blocks as their dense equivalent, before tensor parallelism)."""
    model = dense_equivalent(cfg.model)
    key = repr(model)
    _MODELS[key] = model
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    return _cached_model_ops(key, microbatch, cfg.training.seq_len // cfg.parallelism.cp, dtype)


def optimizer_ops(shard_numels: Iterable[int], training: TrainingConfig) -> OpCount:
    """The trainer's gradient clipping and AdamW step (torch's own, as the trainer
    builds it) on one rank's parameter shards, fp32. Its ops per parameter and bytes
    per element do not depend on the sizes: counted on 1 and 2 small parameters and
    scaled, so thousands of parameters cost nothing to plan."""
    numels = [n for n in shard_numels if n]
    fixed, per_param, per_element = _optimizer_rates(training.lr, training.weight_decay)
    return OpCount(
        fixed.ops + per_param.ops * len(numels),
        fixed.bytes + per_param.bytes * len(numels) + round(per_element * sum(numels)),
    )


_PROBE = 1024  # elements of the counted parameters


def optimizer_step(
    numels: Iterable[int], lr: float, weight_decay: float
) -> Callable[[OpCounter], None]:
    """For ``count_ops``: clipping + AdamW on fp32 parameters of these sizes; the first
    step (which creates the moments) is not counted."""

    def step(counter: OpCounter) -> None:
        counter.phase = "setup"
        params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        for phase in ("setup", "step"):
            counter.phase = phase
            for p in params:
                p.grad = torch.empty_like(p)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


@lru_cache(maxsize=8)
def _optimizer_rates(lr: float, weight_decay: float) -> tuple[OpCount, OpCount, float]:
    one, two, wide = (
        count_ops(optimizer_step(n, lr, weight_decay))["step"]
        for n in ((_PROBE,), (_PROBE, _PROBE), (_PROBE, 2 * _PROBE))
    )
    per_element = (wide.bytes - two.bytes) / _PROBE
    per_param = OpCount(two.ops - one.ops, round(two.bytes - one.bytes - per_element * _PROBE))
    fixed = OpCount(
        one.ops - per_param.ops, round(one.bytes - per_param.bytes - per_element * _PROBE)
    )
    return fixed, per_param, per_element
