"""One pipeline stage as flexshard needs it: torch's ``PipelineStage`` with flexshard's
gradient sync on the last microbatch only, its output checked against the static
shapes the next stage receives into, and the bytes it sends counted (under sequence
parallelism they are 1 / tp of the whole hidden states')."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import flexshard as fs


class StageOutputError(ValueError):
    """A stage's output differs from the static shape or dtype the next stage
    receives into."""


class FlexShardStage(PipelineStage):
    """A PipelineStage that turns flexshard's gradient sync and reshard-after-backward
    on only for the last microbatch's backward (torch does this for FSDP2 modules
    only), checks its output against the static shape and dtype the next stage
    receives into, and counts the bytes it sends (``sent_bytes``: activations forward,
    their gradients backward)."""

    def __init__(self, *args: Any, expected_output: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expected_output = expected_output
        self.sent_bytes = {"forward": 0, "backward": 0}

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.sent_bytes["forward"] += _op_bytes(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.sent_bytes["backward"] += _op_bytes(ops)
        return ops

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        # checked here, before torch validates the output against the static metadata
        # (torch 2.11 always does, with an error that names neither activation_dtype
        # nor sequence_shards), so a mismatch raises flexshard's error on every release
        self._check_output(output)
        return output

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        except RuntimeError as err:
            # torch wraps errors of the forward in a RuntimeError listing the args
            if isinstance(err.__cause__, StageOutputError):
                raise err.__cause__ from None
            raise

    def _check_output(self, output: Any) -> None:
        want = self.expected_output
        if output.shape != want.shape or output.dtype != want.dtype:
            # torch 2.13 checks only under TORCH_DISTRIBUTED_DEBUG=DETAIL (and never
            # the last stage): else the receiver would read garbage
            raise StageOutputError(
                f"pipeline stage {self.stage_index}: output {output.dtype} "
                f"{tuple(output.shape)}, but the stages were built for {want.dtype} "
                f"{tuple(want.shape)} (activation_dtype / sequence_shards)"
            )

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if isinstance(self.submod, fs.FlexShardModule):
            self.submod.set_requires_gradient_sync(last_backward)
            # gathered parameters serve the next microbatch; the last one frees them
            self.submod.set_reshard_after_backward(last_backward)
        return super().backward_maybe_with_nosync(
            backward_type, bwd_kwargs, last_backward=last_backward
        )


def _op_bytes(ops: list[dist.P2POp]) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
