"""Batch-invariant mode: the generator's per-token log-probabilities (decode steps with
the KV cache, batches of any size) equal the trainer's recomputed ones (full causal
forward, other micro-batches, right padding) bit for bit, and each swapped op is
needed: with any one of them back to its native kernel, bits differ. Qwen3.5's Gated
DeltaNet layers add ``token_by_token()`` (the recurrence in every forward), needed too,
and its exp / sigmoid / softplus on whole vectors; MoE routers and the shared expert's
gate take the sigmoid on whole vectors there too."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

from flexshard.trainer.config import config_from_dict
from flexshard.trainer.models import linear_attention
from flexshard.trainer.models.model import Transformer, init_weights
from flexshard.trainer.rl.batch_invariant import OPS, batch_invariant
from flexshard.trainer.rl.rollout import generate, token_logprobs

from .test_deepseek_layouts import MLA_MODEL
from .test_parallel_layouts import QWEN3

EOS = 10
# the model families' attention variants, beside Llama's (the defaults): Qwen3's q/k
# norms, wider heads and tied embeddings; DeepSeek-V3's MLA (latent KV cache, YaRN,
# queries wider than the values); Qwen3.5's Gated DeltaNet layer (conv window and
# recurrent state in the cache, grouped value heads) before its gated attention
QWEN3_5 = {
    "attention": "gated",
    "qk_norm": True,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_attention": {
        "conv_kernel": 3,
        "key_head_dim": 12,
        "value_head_dim": 10,
        "num_key_heads": 2,
        "num_value_heads": 4,
    },
}
# the MoE routers: softmax over all experts (Mixtral), sigmoid scores in groups with a
# routed scale and a shared expert (DeepSeek-V3), softmax with a sigmoid-gated shared
# expert (Qwen3.5-MoE)
MOE = {"num_experts": 4, "top_k": 2, "expert_hidden": 48}
SIGMOID_MOE = {**MOE, "score_func": "sigmoid", "n_group": 2, "topk_group": 1}
SIGMOID_MOE.update(routed_scaling_factor=2.5, num_shared_experts=1)
GATED_MOE = {**MOE, "num_shared_experts": 1, "shared_expert_hidden": 40}
GATED_MOE["shared_expert_gate"] = True
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen3": QWEN3,
    "deepseek_v3": MLA_MODEL,
    "qwen3_5": QWEN3_5,
}
# their routing only: the ops each needs are the attention families' above
MOE_FAMILIES: dict[str, dict] = {
    "mixtral_moe": {"moe": MOE},
    "deepseek_v3_moe": {**MLA_MODEL, "moe": SIGMOID_MOE},
    "qwen3_5_moe": {**QWEN3_5, "moe": GATED_MOE},
}
# sdpa's own entry only routes queries wider than the values (MLA) to the flash kernel
ROUTING = "scaled_dot_product_attention"


@functools.cache
def _model(family: str) -> Transformer:
    """The debug model with its projections scaled up: activations of order 1, as in a
    trained model (at 0.02-std initialisation few elements reach silu's scalar tail)."""
    shape = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 176}
    layers = {**FAMILIES, **MOE_FAMILIES}[family]
    model = Transformer(config_from_dict({"model": {**shape, **layers}}).model)
    init_weights(model, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "tok_embeddings" not in name:
                param.mul_(6.0)
    return model


def _mismatches(model: Transformer, ops: list[str] | None, recurrence: bool = True) -> int:
    """Log-probabilities of generated tokens that differ between the generator and the
    trainer's recompute, over batches of 3 and 5 prompts of 5 and 9 tokens, recomputed
    whole, one row at a time, and two rows at a time with 3 tokens of right padding
    (``recurrence``: inside ``token_by_token()``, as GRPO runs)."""
    bad = 0
    per_token = linear_attention.token_by_token() if recurrence else contextlib.nullcontext()
    with batch_invariant(ops), per_token, torch.no_grad():
        for rows, length, seed in ((3, 5, 0), (5, 9, 1)):
            gen = torch.Generator().manual_seed(seed)
            prompts = torch.randint(0, 256, (rows, length), generator=gen)
            done = generate(model, prompts, 12, EOS, 1.0, gen)
            for micro, pad in ((rows, 0), (1, 0), (2, 3)):
                for start in range(0, rows, micro):
                    chunk = done[start : start + micro]
                    width = max(length + len(c.tokens) for c in chunk) + pad
                    seqs = torch.zeros(len(chunk), width, dtype=torch.long)
                    for i, c in enumerate(chunk):
                        seqs[i, : length + len(c.tokens)] = torch.cat([c.prompt, c.tokens])
                    new = token_logprobs(model(seqs[:, :-1]), seqs[:, 1:], 1.0)
                    for i, c in enumerate(chunk):
                        mine = new[i, length - 1 : length - 1 + len(c.tokens)]
                        bad += int((mine != c.logprobs).sum())
    return bad


@pytest.mark.parametrize("family", sorted({**FAMILIES, **MOE_FAMILIES}))
def test_generator_equals_trainer_bitwise(family):
    assert _mismatches(_model(family), None) == 0
    assert _mismatches(_model(family), []) > 0  # the native kernels: not batch-invariant


@pytest.mark.slow
@pytest.mark.parametrize("dropped", ["recurrence", "whole_vectors"])
def test_delta_net_needs_the_recurrence_and_whole_vectors(dropped, monkeypatch):
    """Qwen3.5: the chunked form in the trainer's forward, or exp / sigmoid / softplus
    with a scalar tail, and the bits differ."""
    if dropped == "whole_vectors":
        monkeypatch.setattr(linear_attention, "whole_vectors", lambda op, x: op(x))
    assert _mismatches(_model("qwen3_5"), None, recurrence=dropped != "recurrence") > 0


def _op_cases() -> list:
    """Every op on Llama; sdpa's routing on MLA, where it matters (elsewhere sdpa takes
    the flash kernel anyway); the other families' ops in the slow suite."""
    cases = []
    for family, model in sorted(FAMILIES.items()):
        for op in sorted(OPS):
            if op == ROUTING and model.get("attention") != "mla":
                continue
            slow = family != "llama" and op != ROUTING
            cases.append(pytest.param(family, op, marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize(("family", "op"), _op_cases())
def test_each_op_is_needed(family, op):
    assert _mismatches(_model(family), [o for o in OPS if o != op]) > 0, op


def _decode_vs_causal(ops: list[str] | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Queries / keys of 24, values of 16 (MLA's shapes): outputs of the causal forward
    that differ from one query at a time against its prefix; the output and the input
    gradient of the causal forward."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 4, 37, 24, generator=gen) for _ in range(2))
    v = torch.randn(3, 4, 37, 16, generator=gen)
    q.requires_grad_(True)
    with batch_invariant(ops):
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        whole.sum().backward()
        bad = 0
        with torch.no_grad():
            for i in range(37):
                mask = torch.ones(1, i + 1, dtype=torch.bool)
                one = F.scaled_dot_product_attention(
                    q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], mask, scale=0.3
                )
                bad += int((one[:, :, 0] != whole[:, :, i]).sum())
    return bad, whole.detach(), q.grad


def test_mla_shapes_take_the_flash_kernel():
    bad, out, grad = _decode_vs_causal(None)
    assert bad == 0
    assert _decode_vs_causal([o for o in OPS if o != ROUTING])[0] > 0  # sdpa's math path
    native, native_grad = _decode_vs_causal([])[1:]
    torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-5)  # the same attention
    torch.testing.assert_close(grad, native_grad, rtol=1e-5, atol=1e-5)


def test_native_kernels_come_back(monkeypatch):
    calls = []
    native = OPS["mm"]
    monkeypatch.setitem(OPS, "mm", lambda a, b: calls.append(1) or native(a, b))
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with batch_invariant():
        inside = torch.mm(a, b)
    assert calls == [1]
    assert torch.allclose(inside, torch.mm(a, b), atol=1e-6)
    assert calls == [1]  # after the block: aten's own kernel
