"""The ops of one rank's unsharded forward + backward, recorded with their shapes, for
the CPU profile's calibration (``flexshard.plan.calibration`` replays each on real
tensors and times it): the ops ``opcount`` counts, each distinct one (same function,
shapes, strides, dtypes, arguments) once with how often it runs and the non-GEMM bytes
``opcount`` gives it, and the FLOPs of the GEMMs and of causal attention as
``steptime.bucket_flops`` counts them, so that rates fitted on the replay are the
planner's own terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from flexshard.torch_internals import FakeTensorMode, TorchDispatchMode, tree_map
from flexshard.trainer.config import Config
from flexshard.trainer.models.model import Transformer

from .opcount import CPU_ATTENTION, non_gemm_bytes

aten = torch.ops.aten
GEMMS = {aten.mm, aten.addmm, aten.bmm}


@dataclass(frozen=True)
class Meta:
    """A tensor argument as recorded: enough to build a real one of the same layout."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def real(self) -> torch.Tensor:
        # storage big enough for the strides (expanded views included), filled once
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride) if s > 0)
        if any(s == 0 for s in self.shape):
            extent = 0
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base = torch.randn(extent, dtype=self.dtype)
        else:  # indices (embedding, loss targets): 0 is valid everywhere
            base = torch.zeros(extent, dtype=self.dtype)
        return base.as_strided(self.shape, self.stride)


class RecordedCall(NamedTuple):
    """A distinct op as recorded: its function, arguments (tensors as :class:`Meta`)
    and the non-GEMM bytes ``opcount`` counts for it."""

    func: Any
    args: Any
    kwargs: Any
    moved: int


def real_arguments(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """A recorded call's arguments with a real random tensor for each :class:`Meta`."""

    def real(m: Any) -> Any:
        return m.real() if isinstance(m, Meta) else m

    return tree_map(real, args), tree_map(real, kwargs)


class OpRecorder(TorchDispatchMode):
    """Counts each distinct op: (function, arguments with tensors as ``Meta``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple, int] = {}
        self.calls: dict[tuple, RecordedCall] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out

        def meta(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                return Meta(tuple(t.shape), tuple(t.stride()), t.dtype)
            return t

        margs, mkwargs = tree_map(meta, args), tree_map(meta, kwargs)
        key = (func, repr(margs), repr(mkwargs))
        if key not in self.calls:  # the bytes as opcount counts them
            self.calls[key] = RecordedCall(
                func, margs, mkwargs, non_gemm_bytes(func, args, kwargs, out)
            )
        self.counts[key] = self.counts.get(key, 0) + 1
        return out


def record_model(cfg: Config) -> OpRecorder:
    """The ops of one rank's unsharded forward + backward (its local batch), fp32."""
    recorder = OpRecorder()
    with FakeTensorMode():
        net = Transformer(cfg.model)
        t = cfg.training
        tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
        with recorder:
            logits = net(tokens)
            F.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), tokens.reshape(-1)
            ).backward()
    return recorder


def op_flops(func: Any, args: tuple) -> tuple[str, float]:
    """(kind, FLOPs): a GEMM's 2 m k n, attention's causal count, else ("op", 0)."""
    packet = func.overloadpacket
    if packet in GEMMS:
        a, b = args[-2].shape, args[-1].shape
        batch = a[0] if len(a) == 3 else 1
        return "gemm", 2.0 * batch * a[-2] * a[-1] * b[-1]
    if packet in CPU_ATTENTION:
        # forward: q [B, H, S, D]; backward: grad_out first, q second (the same shape)
        b, h, s, d = args[1].shape if "backward" in packet.__name__ else args[0].shape
        forward = 4.0 * b * h * s * (s / 2) * d
        return "attention", forward * (2 if "backward" in packet.__name__ else 1)
    return "op", 0.0


def recorded_flops(recorder: OpRecorder) -> dict[str, float]:
    """FLOPs of the recorded GEMMs and attention (as the rates divide them)."""
    total = {"gemm": 0.0, "attention": 0.0, "op": 0.0}
    for key, call in recorder.calls.items():
        kind, flops = op_flops(call.func, call.args)
        total[kind] += recorder.counts[key] * flops
    return total
