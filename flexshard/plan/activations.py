"""Activation memory from a forward/backward under ``FakeTensorMode`` (shapes only, no
compute), measured by torch's ``MemTracker``: a model of 1 and of 2 blocks, so the
difference is one block's saved activations and the rest the embedding/LM-head part.

Approximations (said in the report): a MoE block is measured as a dense block whose
feed-forward is as wide as the experts a token visits (top_k * expert_hidden plus the
shared experts), since routing has data-dependent shapes; tensor parallelism divides
a block's activations by tp with sequence parallelism, else only the ~24/34 of them
inside attention and the MLP (Megatron's 34 s b h accounting); context parallelism
measures a sequence of seq_len / cp tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from flexshard.torch_internals import FakeTensorMode, MemRefType, MemTracker, ModState
from flexshard.trainer.config import ActivationCheckpointConfig, Config, ModelConfig
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.parallel.activation_checkpoint import SAVED_OPS, apply_ac

from .recompute import op_level, recomputed_share


@dataclass(frozen=True)
class ActivationEstimate:
    per_block: int  # bytes one block saves for backward, per microbatch
    head: int  # embedding, final norm, LM head and loss: saved bytes per microbatch
    transient: int  # backward's largest temporary (workspace) on top of the saved ones
    microbatch: tuple[int, int]  # (sequences, tokens per sequence) measured


def dense_equivalent(model: ModelConfig) -> ModelConfig:
    moe = model.moe
    if not moe.num_experts:
        return model
    hidden = moe.expert_hidden or model.ffn_hidden_size()
    out = copy.deepcopy(model)
    out.ffn_hidden = hidden * moe.top_k + moe.shared_width(hidden)
    out.moe.num_experts = 0
    return out


def fake_model(model: ModelConfig, layers: int, dtype: torch.dtype, ac: str) -> Transformer:
    """A ``layers``-block copy of ``model`` built in ``dtype`` with every block
    checkpointed as ``ac`` says ("none", "full", "op" or "op_every_second_mm":
    torchtitan's op policy); call it under FakeTensorMode."""
    cfg = copy.deepcopy(model)
    cfg.n_layers = layers
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        net = Transformer(cfg)
    finally:
        torch.set_default_dtype(previous)
    if ac == "op_every_second_mm":
        for name, block in list(net.layers.named_children()):
            net.layers.register_module(name, _EverySecondMatmulRecomputed(block))
        return net
    mode = {"none": "none", "full": "full", "op": "selective"}[ac]
    apply_ac(net, ActivationCheckpointConfig(mode=mode, selective_ac_option="op"))
    return net


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _every_second_mm_recomputed() -> tuple:
    """torchtitan's op-level policy (``torchtitan/parallelisms/parallelize_llama.py``
    at its performance run's commit 9dec370): save the outputs of the compute ops
    (matmuls, attention, collectives), except every second matmul, counted per forward
    and per recompute of a block."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _EverySecondMatmulRecomputed(torch.nn.Module):
    """A block checkpointed with torchtitan's op-level policy (planning only: the
    trainer's own op policy keeps every matmul)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return checkpoint(
            self.block,
            *args,
            **kwargs,
            use_reentrant=False,
            preserve_rng_state=False,
            context_fn=_every_second_mm_recomputed,
        )


def _measure(
    model: ModelConfig, layers: int, batch: int, seq: int, dtype: torch.dtype, ac: str
) -> dict:
    """``ac``: "none", "full" or "op" (every block checkpointed that way)."""
    with FakeTensorMode():
        net = fake_model(model, layers, dtype, ac)
        tokens = torch.randint(0, model.vocab_size, (batch, seq))
        tracker = MemTracker()
        tracker.track_external(net)
        with tracker:
            logits = net(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), tokens.reshape(-1)
            )
            loss.backward()
    stats = tracker.memory_tracking[net].snapshots
    (device,) = stats[ModState.POST_FW][-1].keys()
    saved = stats[ModState.POST_FW][-1][device][MemRefType.ACT]
    peak = stats[ModState.PEAK_BW][-1][device]
    transient = peak[MemRefType.TEMP] + max(0, peak[MemRefType.ACT] - saved)
    return {"saved": saved, "transient": transient}


@lru_cache(maxsize=32)
def _cached(
    model_key: str, batch: int, seq: int, dtype: torch.dtype, ac: str = "none"
) -> ActivationEstimate:
    model = _MODELS[model_key]
    one = _measure(model, 1, batch, seq, dtype, ac)
    two = _measure(model, 2, batch, seq, dtype, ac)
    per_block = two["saved"] - one["saved"]
    return ActivationEstimate(
        per_block=per_block,
        head=one["saved"] - per_block,
        transient=max(one["transient"], two["transient"]),
        microbatch=(batch, seq),
    )


_MODELS: dict[str, ModelConfig] = {}


def estimate_activations(cfg: Config, microbatch: int) -> ActivationEstimate:
    """One data-parallel rank's activations for a microbatch of ``microbatch`` sequences,
    before tensor parallelism divides them (see :func:`per_rank_activation`)."""
    model = dense_equivalent(cfg.model)
    key = repr(model)
    _MODELS[key] = model
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    seq = cfg.training.seq_len // cfg.parallelism.cp
    plain = _cached(key, microbatch, seq, dtype)
    share = recomputed_share(cfg)
    if not share:
        return plain
    # checkpointed blocks keep what the mode saves; the recompute of one block in
    # backward brings its activations back for a moment (measured in the transient)
    marked = _cached(key, microbatch, seq, dtype, "op" if op_level(cfg) else "full")
    return ActivationEstimate(
        per_block=round(plain.per_block * (1 - share) + marked.per_block * share),
        head=plain.head,
        transient=max(plain.transient, marked.transient),
        microbatch=plain.microbatch,
    )


def tp_share(cfg: Config) -> float:
    """The share of a block's activations one tp rank keeps."""
    tp = cfg.parallelism.tp
    if tp == 1:
        return 1.0
    if cfg.parallelism.sequence_parallel:  # with pp too: stages pass sequence shards
        return 1.0 / tp
    return (10 + 24 / tp) / 34
