"""Newton–Schulz orthogonalisation (as torch.optim.Muon computes it), its batched form
for expert stacks, its cost, and Muon's learning-rate adjustment."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
Shape = tuple[int, ...]


def zeropower(
    matrix: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton–Schulz iteration on one 2-D matrix, in bf16.

    Op for op what ``torch.optim._muon._zeropower_via_newtonschulz`` does, so the
    result is bit for bit the same; ``.to(bfloat16)`` always copies, so an input that
    already is bf16 is never changed in place."""
    a, b, c = coefficients
    x = matrix.to(torch.bfloat16, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # work on the wide side: the Gram matrix is the smaller one
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def zeropower_batched(
    stack: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """Newton–Schulz on every matrix of a ``[E, R, C]`` stack at once (batched GEMMs).

    Each matrix is normalised by its own Frobenius norm, so the result equals
    :func:`zeropower` per matrix up to the rounding of batched bf16 GEMMs."""
    a, b, c = coefficients
    x = stack.to(torch.bfloat16, copy=True)
    tall = stack.size(-2) > stack.size(-1)
    if tall:
        x = x.transpose(-2, -1)
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(norms.clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.transpose(-2, -1) if tall else x


def ns_flops(shape: Shape, steps: int) -> float:
    """Newton–Schulz cost of one matrix (or a stack): ``steps * s*s*(2l + s)`` per
    matrix, s the short side and l the long one (the three GEMMs of one step)."""
    *batch, rows, cols = shape
    short, long = min(rows, cols), max(rows, cols)
    return float(math.prod(batch) * steps * short * short * (2 * long + short))


def adjust_lr(lr: float, adjust_lr_fn: str | None, matrix_shape: Shape) -> float:
    """Muon's per-matrix learning rate: ``"original"`` (the default) scales by
    ``sqrt(max(1, A/B))``, ``"match_rms_adamw"`` by ``0.2 * sqrt(max(A, B))``.
    ``matrix_shape`` is one matrix's (rows, cols): of an expert stack, one expert's."""
    rows, cols = matrix_shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(
            f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
        )
    return lr * ratio
