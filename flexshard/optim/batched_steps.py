"""Batched steps: the matrices of one 3-D stack (the channels ``[1, K]`` of a depthwise
conv kernel ``[C, 1, K]``, the experts ``[out, in]`` of ``[E, out, in]``) stepped by one
call over a leading dimension instead of one inner ``step`` per matrix, for the inner
optimizers whose arithmetic is written out here: pytorch-optimizer's SOAP and Shampoo.

Each matrix keeps its own state (its own tensors in ``optimizer.state[proxy]``, as the
per-matrix step leaves them, so checkpoints and the per-matrix path read it alike): a
batched step stacks the states, runs the optimizer's own sequence of operations on the
stack (batched matmul, ``eigh``, ``qr``, ``svd``, ``argsort``) and copies the results
back. The batched ``eigh``, ``qr`` and ``svd`` run LAPACK matrix by matrix (the same
bits) and elementwise ops round alike anywhere in a batch (``pow`` does not: it runs
matrix by matrix); a batched matmul rounds as the per-matrix one where it calls BLAS
per matrix (on CPU from :data:`SMALL_BMM` multiply-adds per matrix: experts), not in
torch's small-matrix kernel (a conv channel's ``[1, K]``): there SOAP's results differ
from the loop in the last bits (bounded in the tests) and Shampoo, which magnifies
them, keeps the loop. No op's bits depend on the other matrices of the batch, so every
placement and world size gives one process's bits.
Options whose batched form is not written here (SOAP's ``merge_dims``,
``normalize_gradient``, ``maximize``, a subclass) leave the matrices to the per-matrix
path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

Shape = tuple[int, ...]

#: torch's CPU bmm takes a small-matrix kernel (its own rounding) below this many
#: multiply-adds per matrix, and calls BLAS matrix by matrix (mm's rounding) from it on
SMALL_BMM = 400
#: a batch's stacked copies (state, parameter, gradient) stay under this many bytes:
#: large matrices (real experts) go in small batches, tiny ones (conv channels) in one
BATCH_BYTES = 64 * 2**20


def bmm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (plus ``c``: ``addmm``'s ``c + a @ b``) per matrix of the leading dimension."""
    return torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b)


def _stack(states: Sequence[dict[str, Any]], key: str) -> torch.Tensor:
    return torch.stack([s[key] for s in states])


def _stack_list(states: Sequence[dict[str, Any]], key: str, index: int) -> torch.Tensor | None:
    """Factor ``index`` of list entry ``key`` (None where the optimizer keeps none: ``[]``)."""
    first = states[0][key][index]
    if not isinstance(first, torch.Tensor):
        return None
    return torch.stack([s[key][index] for s in states])


def _copy_back(targets: list[torch.Tensor], batch: torch.Tensor) -> None:
    torch._foreach_copy_(targets, list(batch.unbind(0)))


def _separate(batch: torch.Tensor) -> list[torch.Tensor]:
    """Each matrix's own tensor (its own storage: a checkpoint of one matrix's state
    must not carry the whole batch's)."""
    return [t.clone() for t in batch.unbind(0)]


# ---------------------------------------------------------------------------- SOAP
def _soap_project(
    x: torch.Tensor, bases: Sequence[torch.Tensor | None], back: bool
) -> torch.Tensor:
    """SOAP's ``project`` of each ``[R, C]`` matrix of ``x``: ``tensordot`` over dim 0
    with each basis (``back``: its transpose), or a transpose where it keeps none."""
    for basis in bases:
        x = x.transpose(1, 2)
        if basis is not None:
            x = bmm(x, basis.transpose(1, 2) if back else basis)
    return x


def _soap_eigenbases(factors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """SOAP's ``get_orthogonal_matrix``: ``eigh`` of each factor, columns reversed."""
    out: list[torch.Tensor | None] = []
    for m in factors:
        if m is None:
            out.append(None)
            continue
        eye = torch.eye(m.shape[-1], device=m.device, dtype=m.dtype)
        try:
            _, q = torch.linalg.eigh(m + 1e-30 * eye)
        except Exception:  # as SOAP: retry in float64
            _, q = torch.linalg.eigh(m.to(torch.float64) + 1e-30 * eye.to(torch.float64))
            q = q.to(m.dtype)
        out.append(torch.flip(q, dims=[2]))
    return out


def _soap_power_iteration(
    factors: Sequence[torch.Tensor | None],
    bases: Sequence[torch.Tensor | None],
    exp_avg_sq: torch.Tensor,
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """SOAP's ``get_orthogonal_matrix_qr``: one power iteration and a QR per factor,
    the second moment's coordinates sorted as the estimated eigenvalues."""
    out: list[torch.Tensor | None] = []
    for dim, (m, o) in enumerate(zip(factors, bases)):
        if m is None or o is None:
            out.append(None)
            continue
        product = bmm(m, o)
        estimate = (o * product).sum(dim=1)
        order = torch.argsort(estimate, dim=1, descending=True)
        shape = [order.shape[0], 1, 1]
        shape[dim + 1] = order.shape[1]
        exp_avg_sq = torch.take_along_dim(exp_avg_sq, order.view(shape), dim=dim + 1)
        power = torch.take_along_dim(product, order.unsqueeze(1), dim=2)
        q, _ = torch.linalg.qr(power.to(torch.float32))
        out.append(q.to(power.dtype))
    return out, exp_avg_sq


def _soap_statistics(
    grad: torch.Tensor,
    factors: list[torch.Tensor | None],
    bases: list[torch.Tensor | None] | None,
    exp_avg_sq: torch.Tensor,
    beta: float,
    frequency: int,
    step: int,
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """SOAP's ``update_pre_conditioner`` (``bases`` None: the first, by ``eigh``)."""
    sides = ((grad, grad.transpose(1, 2)), (grad.transpose(1, 2), grad))
    for m, (left, right) in zip(factors, sides):
        if m is not None:  # tensordot over the other dim: left @ right
            m.lerp_(bmm(left, right).to(m.dtype), weight=1.0 - beta)
    if bases is None:
        bases = _soap_eigenbases(factors)
    if step > 0 and step % frequency == 0:
        bases, exp_avg_sq = _soap_power_iteration(factors, bases, exp_avg_sq)
    return bases, exp_avg_sq


def _soap_init(
    states: list[dict[str, Any]], grad: torch.Tensor, group: dict[str, Any], step: int
) -> None:
    """SOAP's ``init_group`` for matrices without state (``step``: the group's count
    before this step's increment, as SOAP passes it)."""
    beta = group["shampoo_beta"] if group["shampoo_beta"] is not None else group["betas"][1]
    frequency = group["precondition_frequency"]
    factors: list[torch.Tensor | None] = [
        None if size > group["max_precondition_dim"] else grad.new_zeros(len(states), size, size)
        for size in grad.shape[1:]
    ]
    zeros = grad.new_zeros(grad.shape)
    bases, exp_avg_sq = _soap_statistics(grad, factors, None, zeros, beta, frequency, step)
    own = {
        "exp_avg": _separate(zeros),
        "exp_avg_sq": _separate(exp_avg_sq),
        "GG": [_separate(f) if f is not None else None for f in factors],
        "Q": [_separate(q) if q is not None else None for q in bases],
    }
    for i, state in enumerate(states):
        state["exp_avg"] = own["exp_avg"][i]
        state["exp_avg_sq"] = own["exp_avg_sq"][i]
        state["GG"] = [f[i] if f is not None else [] for f in own["GG"]]
        state["Q"] = [q[i] if q is not None else [] for q in own["Q"]]
        state["precondition_frequency"] = frequency
        state["shampoo_beta"] = beta


def _soap_accepts(optimizer: Optimizer, group: dict[str, Any], shape: Shape) -> bool:
    """Any shape: on small matrices the last bits differ from the loop (see the tests)."""
    return not (
        group["merge_dims"] or group["normalize_gradient"] or getattr(optimizer, "maximize", False)
    )


def _soap_step(optimizer: Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> None:
    """SOAP's ``step`` on ``params`` (same-shaped 2-D matrices with gradients), after
    the inner step counted this step in ``group['step']``."""
    states = [optimizer.state[p] for p in params]
    grad = torch.stack([p.grad for p in params])  # type: ignore[misc]
    fresh = [i for i, s in enumerate(states) if not s]
    if fresh:
        index = torch.tensor(fresh, device=grad.device)
        fresh_grad = grad.index_select(0, index)
        _soap_init([states[i] for i in fresh], fresh_grad, group, group["step"] - 1)
    if group["step"] == 1:  # SOAP's first step only gathers statistics
        return
    beta1, beta2 = group["betas"]
    step = group["step"] - 1
    step_size = group["lr"]
    if group["correct_bias"]:
        step_size *= math.sqrt(1.0 - math.pow(beta2, step)) / (1.0 - math.pow(beta1, step))
    factors = [_stack_list(states, "GG", i) for i in range(2)]
    bases = [_stack_list(states, "Q", i) for i in range(2)]
    exp_avg, exp_avg_sq = _stack(states, "exp_avg"), _stack(states, "exp_avg_sq")
    param = torch.stack(params)

    projected = _soap_project(grad, bases, back=False)
    exp_avg.lerp_(grad, weight=1.0 - beta1)
    exp_avg_sq.lerp_(projected.square(), weight=1.0 - beta2)
    denominator = exp_avg_sq.sqrt().add_(group["eps"])
    update = _soap_project(_soap_project(exp_avg, bases, back=False) / denominator, bases, True)
    param.add_(update, alpha=-step_size)
    if group["weight_decay"] != 0.0:  # decoupled, scaled by the lr (SOAP's call)
        param.mul_(1.0 - group["weight_decay"] * group["lr"])
    beta = states[0]["shampoo_beta"]
    frequency = states[0]["precondition_frequency"]
    bases, exp_avg_sq = _soap_statistics(grad, factors, bases, exp_avg_sq, beta, frequency, step)

    _copy_back(params, param)
    _copy_back([s["exp_avg"] for s in states], exp_avg)
    _copy_back([s["exp_avg_sq"] for s in states], exp_avg_sq)
    for i in range(2):
        for key, batch in (("GG", factors[i]), ("Q", bases[i])):
            if batch is not None:
                _copy_back([s[key][i] for s in states], batch)


# ------------------------------------------------------------------------- Shampoo
def _inverse_root(matrix: torch.Tensor, power: float) -> torch.Tensor:
    """pytorch-optimizer's ``compute_power_svd``, per matrix of the batch."""
    dtype = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    u, s, vh = torch.linalg.svd(matrix.to(dtype), full_matrices=False)
    # matrix by matrix: pow's vectorized and scalar paths round differently, so a
    # value's bits would depend on its place in the batch
    torch._foreach_pow_(list(s.unbind(0)), -1.0 / power)
    return bmm(u * s.unsqueeze(-2), vh).to(matrix.dtype)


def _shampoo_init(states: list[dict[str, Any]], grad: torch.Tensor, group: dict[str, Any]) -> None:
    for i, state in enumerate(states):
        if group["momentum"] > 0.0:
            state["momentum_buffer"] = grad[i].clone()
        for dim, size in enumerate(grad.shape[1:]):
            eye = torch.eye(size, device=grad.device).to(grad.dtype).mul_(group["matrix_eps"])
            state[f"pre_cond_{dim}"] = eye
            state[f"inv_pre_cond_{dim}"] = grad.new_zeros(size, size)


def _shampoo_accepts(optimizer: Optimizer, group: dict[str, Any], shape: Shape) -> bool:
    """Only where every product keeps mm's rounding (both sides of the matrix 8 or
    more): Shampoo's inverse fourth roots of nearly singular factors (a conv channel's
    ``[1, K]``: rank one a step) magnify the small-matrix kernel's last bits to 1e-2
    of a step, so small matrices stay with the per-matrix loop."""
    return min(shape) ** 3 >= SMALL_BMM and not getattr(optimizer, "maximize", False)


def _shampoo_step(optimizer: Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> None:
    """Shampoo's ``step`` on ``params`` (same-shaped 2-D matrices with gradients), after
    the inner step counted this step in ``group['step']``. Like Shampoo, it leaves the
    gradient with the momentum and coupled weight decay it applied."""
    states = [optimizer.state[p] for p in params]
    grad = torch.stack([p.grad for p in params])  # type: ignore[misc]
    fresh = [i for i, s in enumerate(states) if not s]
    if fresh:
        index = torch.tensor(fresh, device=grad.device)
        _shampoo_init([states[i] for i in fresh], grad.index_select(0, index), group)
    param = torch.stack(params)
    changed_grad = False
    if group["momentum"] > 0.0:
        grad.lerp_(_stack(states, "momentum_buffer"), weight=group["momentum"])
        changed_grad = True
    if group["weight_decay"] != 0.0:
        if group["weight_decouple"]:
            rate = 1.0 if group["fixed_decay"] else group["lr"]
            param.mul_(1.0 - group["weight_decay"] * rate)
        else:
            grad.add_(param, alpha=group["weight_decay"])
            changed_grad = True
    recompute = group["step"] % optimizer.preconditioning_compute_steps == 0  # type: ignore[attr-defined]
    factors = [_stack(states, f"pre_cond_{d}") for d in range(2)]
    roots = [_stack(states, f"inv_pre_cond_{d}") for d in range(2)]
    # rows' factor from the gradient, columns' from its transpose (Shampoo's unfoldings)
    factors[0] = bmm(grad, grad.transpose(1, 2), factors[0])
    factors[1] = bmm(grad.transpose(1, 2), grad, factors[1])
    if recompute:
        roots = [_inverse_root(f, 4) for f in factors]
    update = bmm(roots[0], grad)
    update = bmm(update.transpose(1, 2).contiguous().transpose(1, 2), roots[1])
    param.add_(update, alpha=-group["lr"])

    _copy_back(params, param)
    if changed_grad:
        _copy_back([p.grad for p in params], grad)  # type: ignore[misc]
    for d in range(2):
        _copy_back([s[f"pre_cond_{d}"] for s in states], factors[d])
        _copy_back([s[f"inv_pre_cond_{d}"] for s in states], roots[d])
    if "momentum_buffer" in states[0]:
        _copy_back([s["momentum_buffer"] for s in states], update)
    else:  # Shampoo keeps each step's update as the next one's momentum buffer
        for state, own in zip(states, _separate(update)):
            state["momentum_buffer"] = own


# ------------------------------------------------------------------------ registry
Step = Callable[[Optimizer, dict[str, Any], list[torch.Tensor]], None]
Accepts = Callable[[Optimizer, dict[str, Any], Shape], bool]


@dataclass(frozen=True)
class BatchedStep:
    """A batched step for one inner optimizer class: ``accepts(optimizer, group,
    shape)`` says whether a param group's matrices of ``shape`` take it, ``step`` runs it."""

    accepts: Accepts
    step: Step

    def __call__(
        self, optimizer: Optimizer, group: dict[str, Any], params: list[torch.Tensor]
    ) -> None:
        for batch in batches(params, optimizer):
            self.step(optimizer, group, batch)


#: by the class's module and name: a subclass may change the arithmetic
BATCHED = {
    "pytorch_optimizer.optimizer.soap.SOAP": BatchedStep(_soap_accepts, _soap_step),
    "pytorch_optimizer.optimizer.shampoo.Shampoo": BatchedStep(_shampoo_accepts, _shampoo_step),
}


def batched_step_of(optimizer: Optimizer) -> BatchedStep | None:
    """The batched step of ``optimizer``'s exact class, or None (per-matrix steps)."""
    cls = type(optimizer)
    return BATCHED.get(f"{cls.__module__}.{cls.__qualname__}")


def batches(params: list[torch.Tensor], optimizer: Optimizer) -> list[list[torch.Tensor]]:
    """``params`` in runs whose stacked copies stay under :data:`BATCH_BYTES`: the
    per-matrix bytes of the first one's state (or, before it has any, of the matrix
    and its square factors), parameter and gradient."""
    first = params[0]
    state = optimizer.state.get(first) or {}
    values = [x for v in state.values() for x in (v if isinstance(v, list) else [v])]
    numel = sum(t.numel() for t in values if isinstance(t, torch.Tensor))
    numel = numel or 4 * first.numel() + 2 * sum(s * s for s in first.shape)
    per = (numel + 2 * first.numel()) * first.element_size()
    size = max(1, BATCH_BYTES // per)
    return [params[i : i + size] for i in range(0, len(params), size)]
