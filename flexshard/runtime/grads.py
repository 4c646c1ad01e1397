"""A bucket's unsharded gradients between backward and reduction: what no-sync steps
hold back, and the opt-in record of which of them hold a NaN or an inf."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..torch_internals import DTensorSpec
from .tp_params import local_grad

# bit flags per parameter and rank; runtime/grad_check.py exchanges and decodes them
NAN, INF = 1, 2


def nonfinite_codes(grads: Sequence[torch.Tensor | None]) -> list[int]:
    """Per gradient: NAN | INF bits, 0 when finite or absent."""
    codes = []
    for grad in grads:
        code = 0
        if grad is not None and not bool(torch.isfinite(grad).all()):
            code = NAN * bool(torch.isnan(grad).any()) | INF * bool(torch.isinf(grad).any())
        codes.append(code)
    return codes


class GradAccumulator:
    """Per parameter of a bucket: the gradient held back by ``set_requires_gradient_sync
    (False)`` steps (``BucketStorage.hold_dtypes``), and the non-finite codes of the last backward
    when ``check_finite`` is on."""

    def __init__(self, count: int) -> None:
        self.held: list[torch.Tensor | None] = [None] * count
        self.check_finite = False  # opt-in: each backward records NaN/inf per gradient
        self.nonfinite = [0] * count

    def take(
        self, fulls: Sequence[torch.Tensor], tp_specs: Sequence[DTensorSpec | None]
    ) -> list[torch.Tensor | None]:
        """Unsharded gradients of this backward (taken off the full parameters) plus
        those held back by no-sync steps."""
        grads = []
        for i, (full, spec) in enumerate(zip(fulls, tp_specs)):
            grad, full.grad = local_grad(full.grad, spec), None
            held = self.held[i]
            self.held[i] = None
            if held is not None and grad is not None:
                held += grad
            grads.append(held if held is not None else grad)
        if self.check_finite:
            self.nonfinite = nonfinite_codes(grads)
        return grads

    def hold(self, grads: list[torch.Tensor | None], dtypes: Sequence[torch.dtype | None]) -> None:
        """Gradient sync is off: keep ``grads`` for the next backward, each in its
        ``dtypes`` entry (None: as it is)."""
        for i, (grad, dtype) in enumerate(zip(grads, dtypes)):
            if grad is not None and dtype is not None and grad.dtype != dtype:
                grad = grad.to(dtype)
            self.held[i] = grad

    def clear_nonfinite(self) -> None:
        self.nonfinite = [0] * len(self.held)
