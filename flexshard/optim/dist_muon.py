"""DistMuon: torch.optim.Muon on flexshard's local shards.

Where storage holds whole matrices (Owned, full-width BlockShard row blocks with
``row_blocks=True``, whole experts of a 3-D stack, plain tensors) the step computes
locally and issues no collective. Where a placement splits matrices (Shard, FlatShard,
2-D tiles, Replicate) each matrix goes to one owner rank, chosen by LPT on
Newton–Schulz FLOPs: one packed all-to-all per bucket brings the pieces, the owner
orthogonalises, one packed all-to-all per bucket returns each rank its part of the
update. Bucket i+1's forward all-to-all is in flight while bucket i's Newton–Schulz
runs. Momentum and weight decay are elementwise, so they run on the shards and every
piece of state (``momentum_buffer``) is shaped like the local shard it belongs to:
``state_dict()``/``load_state_dict()`` work rank-locally as for any torch optimizer.

Row blocks (``row_blocks=head_dim``) that the storage cuts go the same way: the owner
gets the whole matrix and orthogonalises each block alone (LPT on the blocks' FLOPs);
each rank applies its pieces block by block, each block's lr adjusted by its shape.

Replicate buckets: every rank holds the whole matrix and its (all-reduced) gradient;
the owner computes Newton–Schulz and the back all-to-all shares its update (the
forward needs no collective), so no rank repeats another's Newton–Schulz. HSDP: the
exchanges run in each bucket's shard group; replicas hold equal gradients and compute
the same updates.

Expert stacks ``[E, R, C]``: experts whole on a rank run one batched Newton–Schulz
there; a stack whose experts are cut is redistributed expert by expert (each expert
a matrix with its own LPT owner), so E experts spread over the ranks.

Tensor-parallel matrices (flexshard local shards of a TP DTensor's piece): each gets
one Newton–Schulz owner in its tp group (LPT on FLOPs); the pieces are gathered over
dp, sent to the owner in one packed all-to-all over tp per step, and the update comes
back the same way: bit for bit the whole matrix's Muon step, see ``tp_owners``. (TP
meshes other than 1-D with one Shard placement are gathered whole on every rank.)

Every rank of a shard group must hold gradients for the same parameters (flexshard's
backward gives every rank a gradient, empty where it stores nothing): which matrices
are exchanged is decided from the layout and the parameters that have a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.optim import Optimizer

from ..runtime.dtensor.tensor_parallel import local_of
from .matrices import (
    Kind,
    Rules,
    Shape,
    Target,
    block_runs,
    classify,
    rank_work,
    row_block_shapes,
)
from .newton_schulz import NS_COEFFICIENTS, adjust_lr, ns_flops, zeropower, zeropower_batched
from .redistribute import (
    CommCounter,
    Exchange,
    Transfer,
    assemble,
    local_updates,
    plan_exchanges,
    send_inputs,
    send_updates,
)
from .tp_matrices import gather_matrix, own_part
from .tp_owners import TpCounter, TpExchange, owner_plannable, plan_tp, step_tp

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def _check_ndim(name: str, shape: Shape) -> None:
    if len(shape) not in (2, 3):
        raise ValueError(
            f"DistMuon: {name} has shape {tuple(shape)}; Muon takes 2-D matrices and 3-D "
            "expert stacks [E, R, C] only (give embeddings' 1-D params, norms and biases "
            "to AdamW, e.g. with flexshard.optim.muon_and_adamw)"
        )


#: Muon orthogonalises 2-D matrices and [E, R, C] stacks of them (tensor-parallel: 2-D)
RULES = Rules(
    "DistMuon",
    foreign=" (tensor parallel?); DistMuon takes flexshard's parameters (tensor-parallel "
    "ones included: shard the model with flexshard after apply_tp) and plain tensors",
    tp_split="DistMuon takes whole 2-D tensor-parallel matrices, or row_blocks in "
    "column-parallel (Shard(0)) pieces cut at block boundaries",
    check_shape=_check_ndim,
    tp_2d_only=True,
    remote_row_blocks=True,
)


def resolve(param: torch.Tensor, name: str, group: dict) -> Target:
    """Classify ``param`` for DistMuon (a 2-D matrix or a 3-D expert stack), in ``group``."""
    target = classify(param, name, group["row_blocks"], RULES)
    target.group = group
    return target


def check_muon_hyperparameters(group: dict, where: str) -> None:
    """ValueError/TypeError for hyper-parameters Muon cannot run with (before any step)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"DistMuon {where}: a tensor lr must have one element")
        lr = lr.item()
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"DistMuon {where}: lr must be a finite number >= 0, got {lr!r}")
    momentum = group["momentum"]
    if not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"DistMuon {where}: momentum must be in [0, 1), got {momentum!r}")
    if not isinstance(group["weight_decay"], (int, float)) or group["weight_decay"] < 0:
        raise ValueError(
            f"DistMuon {where}: weight_decay must be >= 0, got {group['weight_decay']!r}"
        )
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"DistMuon {where}: ns_steps must be an int, got {steps!r}")
    if not 0 <= steps < 100:
        raise ValueError(
            f"DistMuon {where}: ns_steps must be in [0, 100) (Newton–Schulz converges in a "
            f"handful of steps), got {steps}"
        )
    if len(tuple(group["ns_coefficients"])) != 3:
        raise ValueError(f"DistMuon {where}: ns_coefficients must be 3 numbers (a, b, c)")
    if not group["eps"] >= 0:
        raise ValueError(f"DistMuon {where}: eps must be >= 0, got {group['eps']!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"DistMuon {where}: adjust_lr_fn must be one of {ADJUST_LR_FNS}, "
            f"got {group['adjust_lr_fn']!r}"
        )


class DistMuon(Optimizer):
    """``torch.optim.Muon`` for flexshard local shards (and plain tensors).

    Extra per-group option ``row_blocks`` (default False): Muon per row block, each
    block a matrix of its own (one attention head of a fused QKV). An int gives the
    rows per block (``head_dim``): storage that holds whole blocks (e.g.
    ``BlockShard((k * head_dim, C))``, a plain tensor) computes them without
    communication; storage that cuts blocks (``Shard(0)`` over more ranks than heads,
    ``FlatShard``) redistributes the matrix like any split one, and its owner
    orthogonalises block by block. True takes each stored full-width BlockShard tile
    as a block.
    Learning rates adjust by each matrix's shape (a block's, one expert's).
    ``comm_stats()`` counts the step's all-to-alls and the bytes this rank sent.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        row_blocks: bool | int = False,
    ) -> None:
        self._targets: dict[int, Target] = {}
        self._plan: tuple[tuple[int, ...], list[Exchange]] | None = None
        self._tp_plan: tuple[tuple[int, ...], list[TpExchange]] | None = None
        self.comm = CommCounter()
        self.tp_comm = TpCounter()
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "row_blocks": row_blocks,
        }
        check_muon_hyperparameters(defaults, "defaults")
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups
    def _is_muon(self, group: dict) -> bool:
        return True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if not self._is_muon(group):
            return
        where = f"param group {len(self.param_groups) - 1}"
        check_muon_hyperparameters(group, where)
        names = group.get("param_names")
        for i, param in enumerate(group["params"]):
            name = f"'{names[i]}'" if names else f"parameter {i} of {where}"
            self._targets[id(param)] = resolve(param, name, group)
        self._plan = None

    def comm_stats(self, reset: bool = False) -> dict[str, int]:
        """All-to-alls issued by ``step()`` and the bytes this rank sent and received;
        with tensor-parallel matrices also ``tp_all_gather`` (their dp gathers, whose
        bytes count in the totals) and ``tp_newton_schulz`` (the TP matrices this rank
        orthogonalised)."""
        stats = self.comm.as_dict()
        tp = self.tp_comm
        if self._tp_plan is not None and self._tp_plan[1]:
            stats["bytes_sent"] += tp.bytes_sent
            stats["bytes_received"] += tp.bytes_received
            stats["tp_all_gather"] = tp.all_gather
            stats["tp_newton_schulz"] = tp.newton_schulz
        if reset:
            self.comm, self.tp_comm = CommCounter(), TpCounter()
        return stats

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        updates: list[tuple[Target, torch.Tensor]] = []
        for group in self.param_groups:
            if not self._is_muon(group):
                continue
            for param in group["params"]:
                if param.grad is None:
                    continue
                target = self._targets[id(param)]
                target.group = group
                updates.append((target, self._momentum_update(param, group)))
        exchanges = self._exchanges([t for t, _ in updates])
        inputs = {id(t.param): u for t, u in updates}
        tp_owned = [t for t, _ in updates if t.kind is Kind.TENSOR_PARALLEL and owner_plannable(t)]
        owner_planned = {id(t.param) for t in tp_owned}
        forward = send_inputs(exchanges[0], inputs, self.comm) if exchanges else None
        for target, update in updates:  # whole matrices: overlaps the first all-to-all
            if target.kind is not Kind.REMOTE and id(target.param) not in owner_planned:
                self._step_local(target, update)
        for plan in self._tp_exchanges(tp_owned):  # TP matrices: one owner per tp group
            step_tp(plan, inputs, self._orthogonalize, self._apply_part, self.comm, self.tp_comm)
        backs: list[tuple[Exchange, Transfer]] = []
        for k, exchange in enumerate(exchanges):
            assert forward is not None
            received = forward.wait()
            if k + 1 < len(exchanges):  # in flight during this bucket's Newton–Schulz
                forward = send_inputs(exchanges[k + 1], inputs, self.comm)
            fulls = assemble(exchange, received)
            owned = [self._orthogonalize(u.target, f) for u, f in zip(exchange.owned(), fulls)]
            backs.append((exchange, send_updates(exchange, owned, self.comm)))
            if len(backs) > 1:
                self._apply_remote(*backs.pop(0))
        for exchange, back in backs:
            self._apply_remote(exchange, back)

    def _momentum_update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """Momentum (and Nesterov's look-ahead) on the shard: elementwise, bit for bit
        what torch.optim.Muon computes on the same elements of the full matrix."""
        state = self.state[param]
        if "momentum_buffer" not in state:  # placed like the gradient (a DTensor for
            # flexshard's parameters, so torch's state-dict tools see the whole state)
            state["momentum_buffer"] = torch.zeros_like(
                param.grad, memory_format=torch.preserve_format
            )
        buf, grad = local_of(state["momentum_buffer"]), local_of(param.grad)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _exchanges(self, targets: list[Target]) -> list[Exchange]:
        """The redistribution plan for the parameters that have gradients this step
        (cached): owners balance on top of the work ranks do on whole matrices."""
        key = tuple(id(t.param) for t in targets)
        if self._plan is None or self._plan[0] != key:
            loads: dict[int, list[float]] = {}
            for target in targets:
                work = rank_work(target, partial(ns_flops, steps=target.group["ns_steps"]))
                if work is not None:
                    load = loads.setdefault(len(work), [0.0] * len(work))
                    loads[len(work)] = [a + b for a, b in zip(load, work)]
            remote = [t for t in targets if t.kind is Kind.REMOTE]
            self._plan = (key, plan_exchanges(remote, _remote_cost, loads))
        return self._plan[1]

    def _tp_exchanges(self, targets: list[Target]) -> list[TpExchange]:
        """The owner plan of the TP matrices that have gradients this step (cached)."""
        key = tuple(id(t.param) for t in targets)
        if self._tp_plan is None or self._tp_plan[0] != key:
            cost = lambda t: ns_flops(t.shape, t.group["ns_steps"])  # noqa: E731
            self._tp_plan = (key, plan_tp(targets, cost))
        return self._tp_plan[1]

    @classmethod
    def _apply_part(cls, target: Target, part: torch.Tensor) -> None:
        cls._apply(target, part, target.shape)

    @staticmethod
    def _orthogonalize(target: Target, matrix: torch.Tensor) -> torch.Tensor:
        group = target.group
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        if matrix.ndim == 3:
            return zeropower_batched(matrix, *args)
        if target.kind is Kind.REMOTE and target.rows:  # a row-block matrix on its owner
            return torch.cat([zeropower(block, *args) for block in matrix.split(target.rows)])
        return zeropower(matrix, *args)

    @staticmethod
    def _apply(target: Target, update: torch.Tensor, matrix_shape: tuple[int, ...]) -> None:
        group = target.group
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        target.param.mul_(1 - lr * group["weight_decay"])  # decoupled, unadjusted lr
        target.param.add_(update, alpha=-adjust_lr(lr, group["adjust_lr_fn"], matrix_shape))

    def _step_local(self, target: Target, update: torch.Tensor) -> None:
        param = target.param
        if target.kind is Kind.WHOLE:
            self._apply(target, self._orthogonalize(target, update), target.shape)
        elif target.kind is Kind.TENSOR_PARALLEL:
            assert target.bucket is not None
            bucket, index = target.bucket, target.index
            matrix = gather_matrix(bucket, index, update)
            whole = self._orthogonalize(target, matrix)
            self._apply(target, own_part(bucket, index, whole), target.shape)
        elif target.kind is Kind.EXPERTS:
            rows, cols = target.shape[-2:]
            stack = self._orthogonalize(target, update.reshape(-1, rows, cols))
            self._apply(target, stack.reshape(param.shape), target.shape)
        elif target.kind is Kind.ROW_BLOCKS:
            flat_update, flat_param = update.reshape(-1), param.view(-1)
            for block in target.blocks:
                numel = math.prod(block.shape)
                piece = flat_update[block.offset : block.offset + numel].view(block.shape)
                view = flat_param[block.offset : block.offset + numel].view(block.shape)
                sub = Target(view, target.name, target.group, Kind.WHOLE, block.shape)
                self._apply(sub, self._orthogonalize(sub, piece), block.shape)

    def _apply_remote(self, exchange: Exchange, back: Transfer) -> None:
        # piece by piece: weight decay and the update are elementwise, every element of
        # the local shard is in exactly one piece; a row-block matrix's piece run by
        # run, each run in one block, whose shape adjusts its lr
        for unit, piece, param, update in local_updates(exchange, back.wait()):
            group, rows = unit.target.group, unit.target.rows
            runs = [(0, piece.region.numel, unit.shape)]
            if rows:
                runs = block_runs(piece.region, unit.shape, rows)
            for start, numel, shape in runs:
                part = Target(
                    param[start : start + numel], unit.target.name, group, Kind.WHOLE, shape
                )
                self._apply(part, update[start : start + numel], shape)


def _remote_cost(target: Target, shape: Shape) -> float:
    """Newton–Schulz FLOPs of a redistributed matrix: of each row block, with row_blocks."""
    steps = target.group["ns_steps"]
    shapes = row_block_shapes(shape, target.rows) if target.rows else [shape]
    return sum((ns_flops(block, steps) for block in shapes), 0.0)
