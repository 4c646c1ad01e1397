"""Each op of the RL forward, one at a time: a row of a batch of 17 equals the same row
computed alone (and in batches of other odd sizes), bit for bit, on 1 and 2 threads.
The swapped ops (``OPS``) pass inside ``batch_invariant()`` and, where the native
kernel is batch-dependent, fail outside it; the ops that keep their native kernels
(the norms, log-softmax, RoPE, the elementwise rest) pass without the mode."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from flexshard.trainer.models.layers import RMSNorm, apply_rope, rope_tables
from flexshard.trainer.rl.batch_invariant import CHUNK, batch_invariant
from flexshard.trainer.rl.rollout import token_logprobs

ROWS = 17
SIZES = (1, 5, ROWS)  # batches whose rows are compared with the same rows of ROWS


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _mismatched_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Rows of ``fn(x[:n])`` (n in SIZES, and each row alone) that differ in any bit
    from the same rows of ``fn(x)``."""
    whole = fn(x)
    bad = sum(int((fn(x[i : i + 1]) != whole[i : i + 1]).any()) for i in range(len(x)))
    for n in SIZES:
        bad += int((fn(x[:n]) != whole[:n]).flatten(1).any(1).sum())
    return bad


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# the model's projections (dim 64, ffn 176, vocab 256) and a long reduction
@pytest.mark.parametrize(
    ("k", "n", "tokens"), [(64, 176, 1), (176, 64, 9), (64, 256, 21), (1280, 64, 3)]
)
def test_mm(threads, k, n, tokens):
    weight = _randn(k, n, seed=1)
    x = _randn(ROWS, tokens, k)

    def linear(rows: torch.Tensor) -> torch.Tensor:  # [rows * tokens, k] @ [k, n]
        return torch.mm(rows.reshape(-1, k), weight).view(len(rows), tokens, n)

    with batch_invariant(["mm"]):
        assert _mismatched_rows(linear, x) == 0
    if tokens == 1:  # at 1, 5 and 17 rows BLAS blocks the rows otherwise
        assert _mismatched_rows(linear, x) > 0


@pytest.mark.parametrize("width", [176, CHUNK + 7])  # one chunk; past the parallel grain
def test_silu(threads, width):
    x = _randn(ROWS, width, scale=4.0)
    with batch_invariant(["silu"]):
        assert _mismatched_rows(F.silu, x) == 0
    assert _mismatched_rows(F.silu, x) > 0  # the scalar tail's exp


@pytest.mark.parametrize("keys", [9, 37])  # one key tile; three, the last one partial
def test_attention_decode_equals_causal(threads, keys):
    """Each row's query i against keys 0..i (decode with a cache) equals the causal
    forward's row i, in batches of 1, 5 and 17."""
    q, k, v = (_randn(ROWS, 4, keys, 16, seed=s) for s in (0, 1, 2))

    def causal(rows: slice) -> torch.Tensor:
        return F.scaled_dot_product_attention(q[rows], k[rows], v[rows], is_causal=True)

    def decoded(rows: slice) -> torch.Tensor:
        steps = []
        for i in range(keys):
            mask = torch.ones(1, i + 1, dtype=torch.bool)
            one = q[rows, :, i : i + 1], k[rows, :, : i + 1], v[rows, :, : i + 1]
            steps.append(F.scaled_dot_product_attention(*one, attn_mask=mask))
        return torch.cat(steps, 2)

    def mismatches() -> int:
        whole = causal(slice(None))
        bad = sum(int((decoded(slice(n)) != whole[:n]).sum()) for n in SIZES)
        return bad + sum(int((causal(slice(n)) != whole[:n]).sum()) for n in SIZES)

    with batch_invariant():
        assert mismatches() == 0
    assert mismatches() > 0  # the native kernel's key blocks follow the key count


def _rope(x: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_tables(x.shape[1], 16, 10000.0, x.device)
    return apply_rope(x, cos, sin)


NATIVE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]] = {
    "rms_norm": (RMSNorm(64, 1e-6), (ROWS, 9, 64)),
    "log_softmax": (lambda x: token_logprobs(x, x.argmax(-1), 0.7), (ROWS, 9, 256)),
    "rope": (_rope, (ROWS, 9, 4, 16)),
    "silu_times_up": (lambda x: x[..., :176] * x[..., 176:], (ROWS, 9, 352)),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_kernels_already_invariant(threads, name):
    fn, shape = NATIVE[name]
    with torch.no_grad():
        assert _mismatched_rows(fn, _randn(*shape, scale=3.0)) == 0


@pytest.mark.parametrize("mask", ["causal", "none", "bool", "additive"])
@pytest.mark.parametrize(("queries", "keys"), [(9, 9), (1, 37), (5, 300)])
def test_attention_is_the_native_attention(mask, queries, keys):
    """The same attention as aten's (to rounding), every kind of mask, past one
    value tile of keys."""
    q = _randn(3, 4, queries, 16, seed=0)
    k, v = (_randn(3, 4, keys, 16, seed=s) for s in (1, 2))
    kwargs: dict = {"is_causal": mask == "causal"}
    if mask == "causal" and queries != keys:
        pytest.skip("causal: queries and keys of one length")
    if mask == "bool":
        kwargs["attn_mask"] = _randn(queries, keys, seed=3) > -1.0
    if mask == "additive":
        kwargs["attn_mask"] = _randn(queries, keys, seed=3)
    with batch_invariant():
        ours = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, **kwargs))
