"""Activation checkpointing (``[activation_checkpoint]``), torchtitan's ``apply_ac``:
each chosen transformer block keeps only its inputs through forward and recomputes
the rest in backward, trading one more forward of the block for its activations.

- ``mode = "full"``: every block recomputed whole.
- ``mode = "selective"``, ``selective_ac_option = "n"``: every n-th block (blocks
  ``n-1, 2n-1, ...`` of the whole model, so a pipeline stage picks the blocks the single
  process would) recomputed whole, the others kept.
- ``mode = "selective"``, ``selective_ac_option = "op"``: every block, but the outputs
  of its matmuls, attention kernels and functional (TP) collectives are saved
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``); only the cheap
  elementwise work (norms, RoPE, SwiGLU's gate, residual adds) is recomputed.

Applied after TP / EP / PP / CP and before ``[compile]`` and data parallelism, so the
data-parallel hooks (flexshard's or FSDP2's) sit *outside* the recomputed region: the
block's parameters are gathered once for its backward (by the pre-backward hook) and
the recompute runs on that gather, issuing no data-parallel collective. Recomputing is
the same ops on the same inputs in the same order, so losses and gradients equal a
run without it bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import flexshard as fs
from flexshard.torch_internals import disable_current_modes, functional_collective_ops

from ..config import ActivationCheckpointConfig


def _ops(namespace: Any, names: tuple[str, ...]) -> frozenset[Any]:
    """The ``.default`` overloads of the ops this torch build has."""
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


#: what op-level selective AC keeps: matmuls (the FLOPs), attention kernels (their
#: outputs and log-sum-exp) and functional collectives (DTensor's TP gathers and
#: reduce-scatters: a recompute then issues no TP collective); norms, RoPE, SwiGLU's
#: gate and residual adds are recomputed
SAVED_OPS = _ops(
    torch.ops.aten,
    (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ),
) | _ops(
    functional_collective_ops(),
    ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"),
)


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_contexts() -> tuple[Any, Any]:
    # fresh per call: the contexts hold the saved outputs of one forward
    return create_selective_checkpoint_contexts(_keep_matmuls)


# non-reentrant: works with hooks, DTensors and compile; no RNG state to restore because
# the blocks draw no random numbers. Full recompute keeps the block's input alone, so
# the block's own TP / CP / EP exchanges run again in its recompute (as in torchtitan
# and Megatron: keeping a TP all-gather's output would cost two [batch, seq, dim]
# activations per block); the data-parallel gathers never do
_full: Callable[..., torch.Tensor] = functools.partial(
    checkpoint, use_reentrant=False, preserve_rng_state=False
)
_op_level: Callable[..., torch.Tensor] = functools.partial(
    checkpoint, use_reentrant=False, preserve_rng_state=False, context_fn=_op_level_contexts
)


Checkpoint = Callable[..., torch.Tensor]


def _gathering_inner_units(block: nn.Module, checkpoint_fn: Checkpoint) -> Checkpoint:
    """``checkpoint_fn`` for a block holding a data-parallel unit of its own (EP's
    experts, sharded on their own mesh): the recompute gathers that unit first, outside
    the recompute's dispatch mode. Its pre-forward hook would gather it in the middle of
    the recompute instead, where op-level AC replays only the forward's ops (the forward
    found it prefetched); its backward, which comes next, needs it gathered anyway."""

    def run(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        calls = [0]

        def body(*inputs: torch.Tensor) -> torch.Tensor:
            if calls[0]:  # the recompute, inside backward
                with disable_current_modes():
                    for unit in block.modules():
                        if unit is not block and isinstance(unit, (fs.FlexShardModule, FSDPModule)):
                            unit.unshard()
            calls[0] += 1
            return fn(*inputs)

        return checkpoint_fn(body, *args)

    return run


def checkpointed_blocks(names: list[str], ac: ActivationCheckpointConfig) -> list[str]:
    """The blocks (by their index in the whole model) that ``ac`` recomputes."""
    if ac.mode == "none":
        return []
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        every = int(ac.selective_ac_option)
        return [name for name in names if (int(name) + 1) % every == 0]
    return list(names)


def apply_ac(model: nn.Module, ac: ActivationCheckpointConfig) -> None:
    """Mark the chosen blocks of ``model`` (a Transformer or a pipeline stage of one)
    to recompute in backward; ``mode = "none"`` leaves it as it is."""
    layers = dict(model.layers.named_children())  # type: ignore[union-attr]
    op_level = ac.mode == "selective" and ac.selective_ac_option == "op"
    for name in checkpointed_blocks(list(layers), ac):
        block = layers[name]
        checkpoint_fn: Checkpoint = _op_level if op_level else _full
        # the MoE's experts on their own data-parallel unit under EP (DeepSeek-V4: ``ffn``)
        ffn = getattr(block, "feed_forward", None) or getattr(block, "ffn", None)
        experts = getattr(ffn, "experts", None)
        if getattr(experts, "expert_parallel", None) is not None:
            checkpoint_fn = _gathering_inner_units(block, checkpoint_fn)
        block.checkpoint = checkpoint_fn  # type: ignore[union-attr]
