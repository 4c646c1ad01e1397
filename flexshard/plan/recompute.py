"""Activation checkpointing (``[activation_checkpoint]``) in the plan: which share of
the blocks recompute, what their recompute costs in step time, and what a recompute
keeps besides the block's input.

- ``full`` and ``selective`` every n-th block: a recomputed block runs its forward
  again in backward (GEMMs and the rest), once per microbatch.
- ``selective`` by op: matmul and attention outputs are kept, so the recompute is the
  forward's non-GEMM part alone (norms, RoPE, SwiGLU's gate, residual adds).
- ``selective`` by op also keeps the outputs of a block's functional (TP) collectives,
  so that its recompute issues no TP collective: under tensor parallelism about two
  ``[batch, seq, dim]`` activations per block (the gathered inputs of attention and the
  MLP), measured nowhere else since the plan's activation model runs one process.
  ``full`` keeps the block's input alone and runs its TP exchanges again.
"""

from __future__ import annotations

from flexshard.trainer.config import Config


def recomputed_share(cfg: Config) -> float:
    """The share of the blocks whose forward reruns in backward."""
    ac = cfg.activation_checkpoint
    if ac.mode == "none":
        return 0.0
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        n_layers = cfg.model.n_layers
        return (n_layers // int(ac.selective_ac_option)) / n_layers
    return 1.0


def op_level(cfg: Config) -> bool:
    ac = cfg.activation_checkpoint
    return ac.mode == "selective" and ac.selective_ac_option == "op"


def recompute_parts(cfg: Config, op_recomputed_mm: float = 0.0) -> tuple[float, float]:
    """(share of a block's forward GEMM time, share of its non-GEMM time) added to its
    backward by the recompute; ``op_recomputed_mm``: the share of matmuls an op-level
    policy recomputes too (the trainer's none; torchtitan's every second one)."""
    share = recomputed_share(cfg)
    return (share * op_recomputed_mm, share) if op_level(cfg) else (share, share)


def kept_collective_bytes(cfg: Config, sequences: int, itemsize: int) -> int:
    """Bytes one op-level checkpointed block keeps for its TP collectives' outputs (one tp rank,
    one microbatch of ``sequences``): the gathered (or all-reduced) inputs of attention
    and the MLP. Without tensor parallelism there are none."""
    if cfg.parallelism.tp == 1 or not op_level(cfg):
        return 0
    tokens = sequences * cfg.training.seq_len // cfg.parallelism.cp
    return 2 * tokens * cfg.model.dim * itemsize
