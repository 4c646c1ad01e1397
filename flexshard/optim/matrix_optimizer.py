"""MatrixOptimizer: any per-matrix ``torch.optim.Optimizer`` (Shampoo, SOAP, PSGD, ...)
on flexshard's sharded parameters, unchanged.

The inner optimizer, built from the class or factory it is given, never sees a DTensor
or a shard: its parameters are *proxies*, plain tensors each holding one whole matrix.

* Storage that holds whole matrices (Owned, whole experts of a ``[E, R, C]`` stack,
  plain tensors): the proxies view the local storage and the inner step updates it in
  place. No collective.
* Storage that splits matrices (Shard, FlatShard, tiles, Replicate): each matrix has
  an owner rank (LPT on the optimizer's per-matrix ``cost``, on top of the work ranks
  do on their whole matrices). DistMuon's redistribution moves them: one packed
  all-to-all per bucket brings the owner every piece of gradient and parameter, the
  owner steps its proxy (a full copy), one packed all-to-all per bucket sends each rank
  its part of the new parameter. All buckets' all-to-alls are in flight together, and
  the inner ``step()`` runs once per step over every matrix this rank computes (an
  optimizer may count its calls on itself: heavyball's schedules do).
  The arithmetic on a matrix is the inner optimizer's on the full matrix, so
  results equal one process's bit for bit.
* ``row_blocks`` (DistMuon's option, per group): each stored row block is a matrix of
  its own, stepped in place where it is stored (DistMuon's block layout and checks).
  A mapping of FQN globs to options (``muon_and_adamw``'s form) gives each named
  parameter its own: the given groups are split by option at construction.
* Tensor-parallel matrices: gathered whole (dp, then tp: DistMuon's ``tp_matrices``)
  with their gradient on every rank, which steps its own copy and keeps its part;
  per-head blocks in column-parallel pieces cut at block boundaries need no gather.
* 3-D stacks (experts, a depthwise conv kernel's channels): where the inner optimizer
  has a batched step (:mod:`.batched_steps`: pytorch-optimizer's SOAP and Shampoo), the
  matrices of a stack this rank computes are stepped in one batched call, with the
  per-matrix results and state; otherwise one matrix at a time.

Param groups are the adapter's (``lr`` schedulers edit them); before each inner step
the inner optimizer's groups are refreshed from them, and what the inner step writes
back into a group (a ``step`` counter) is kept. The inner state of each matrix is one
:class:`MatrixState` in ``state[param][state_key]``, so ``fs.checkpoint`` saves it once
and loads it on whichever rank computes the matrix under a new world size or placement;
torch's ``get_/set_optimizer_state_dict`` work too (see :mod:`.matrix_state_dict`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.optim import Optimizer

from ..runtime.dtensor.tensor_parallel import local_of
from ..torch_internals import full_state_dict_call
from .batched_steps import batched_step_of
from .matrix_calls import check_steps_per_call
from .matrix_proxies import (
    Cost,
    MatrixState,
    Resolved,
    grad_view,
    preconditioner_flops,
    resolve_param,
    state_key,
)
from .matrix_state_dict import full_state, saved_matrix
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

WHO = "MatrixOptimizer"
#: group entries that belong to the adapter, not to the inner optimizer
OWN_KEYS = ("params", "param_names", "row_blocks")


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """The param groups ``params`` names, as torch reads them (tensors, (name, tensor)
    pairs or dicts), each a new dict: the caller's are not changed."""
    items = list(params)
    if not items:
        raise ValueError(f"{WHO}: got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        return [dict(item) for item in items]
    return [{"params": items}]


def _named(group: dict[str, Any], index: int) -> list[tuple[str, Any]]:
    """A group's (name, parameter) pairs: from (name, tensor) items or its
    ``param_names``; raises where the parameters have no names."""
    params = list(group["params"])
    if all(isinstance(p, tuple) and len(p) == 2 for p in params):
        return [(n, p) for n, p in params]
    names = group.get("param_names")
    if names is None:
        raise ValueError(
            f"{WHO}: row_blocks by FQN glob needs named parameters (named_parameters() "
            f"or param_names); param group {index} has none"
        )
    return list(zip(names, params))


def _split_by_blocks(
    groups: list[dict[str, Any]], row_blocks: Mapping[str, bool | int]
) -> list[dict[str, Any]]:
    """Each group split into groups of one ``row_blocks`` option: the first glob of
    ``row_blocks`` that matches a parameter's name gives its option (none: False)."""
    out = []
    for index, group in enumerate(groups):
        named = _named(group, index)
        options = [
            next((v for glob, v in row_blocks.items() if fnmatch.fnmatchcase(n, glob)), False)
            for n, _ in named
        ]
        for option in dict.fromkeys(options):  # distinct, in first-seen order
            members = [m for m, o in zip(named, options) if o == option]
            out.append(
                {
                    **group,
                    "params": [p for _, p in members],
                    "param_names": [n for n, _ in members],
                    "row_blocks": option,
                }
            )
    return out


def _options(group: dict[str, Any]) -> dict[str, Any]:
    """A group's options for the inner optimizer: without the adapter's own entries."""
    return {k: v for k, v in group.items() if k not in OWN_KEYS}


class MatrixOptimizer(Optimizer):
    """Run ``optimizer(params, **defaults)`` (a ``torch.optim.Optimizer`` class or
    factory written for full tensors) on flexshard parameters, one whole matrix at a
    time. ``cost(shape)`` is the inner optimizer's work on one matrix (default:
    :func:`preconditioner_flops`); owners of split matrices are balanced on it.
    ``row_blocks`` (also per param group) is DistMuon's: each row block its own matrix
    (an int: rows per block, the storage holding whole blocks; True: each stored
    full-width tile), stepped where it is stored, with no communication; or a mapping
    of FQN globs to such options, per named parameter (``params`` from
    ``named_parameters()`` or with ``param_names``), e.g. the trainer's per-head and
    per-latent blocks (``muon_row_blocks``).
    ``overlap=True`` calls the inner ``step()`` once per bucket, each while the next
    bucket's gather is in flight: for optimizers that keep no count of their calls on
    themselves (checked at construction; pytorch-optimizer's and torch's keep none,
    heavyball's do).
    ``batched=False`` steps every matrix of a 3-D stack on its own, through the inner
    optimizer, even where a batched step exists (the same results, one call each).
    ``comm_stats()`` counts the step's all-to-alls and bytes. Build it after sharding."""

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: Callable[..., Optimizer],
        *,
        cost: Cost | None = None,
        row_blocks: bool | int | Mapping[str, bool | int] = False,
        overlap: bool = False,
        batched: bool = True,
        **defaults: Any,
    ) -> None:
        groups = _as_groups(params)
        if isinstance(row_blocks, Mapping):  # per name: the groups carry plain options
            groups, row_blocks = _split_by_blocks(groups, row_blocks), False
        # the inner optimizer's own defaults and checks, on one placeholder matrix per
        # group (some, torch's Muon among them, check the shapes they are given); it
        # sees each group's own options, as it would see the user's groups
        self._inner = optimizer(
            [{**_options(g), "params": [torch.zeros(1, 1, requires_grad=True)]} for g in groups],
            **defaults,
        )
        # what the inner __init__ set per group (pytorch-optimizer's Muon family fills
        # 'use_muon' groups with keys that are not in its .defaults): the adapter's
        # groups start from these, so the inner step finds every key it set
        self._initial_options = [_options(g) for g in self._inner.param_groups]
        inner_type = type(self._inner)
        self._tag = f"{inner_type.__module__}.{inner_type.__qualname__}"
        self._overlap = overlap
        if overlap:
            check_steps_per_call(self._inner, self._tag)
        self._cost = cost or preconditioner_flops
        self._batched = batched_step_of(self._inner) if batched else None
        # the 3-D stack each proxy belongs to, by id(proxy): its matrices go in one batch
        self._stack_of: dict[int, int] = {}
        self._resolved: dict[int, Resolved] = {}  # by id(param)
        self._group_of: dict[int, int] = {}
        self._owned: dict[tuple[int, int | None], torch.Tensor] = {}  # remote proxies here
        self._tp: dict[int, torch.Tensor] = {}  # whole tensor-parallel matrices, by id(param)
        self._plan: list[Exchange] | None = None
        self._step_plan: tuple[tuple[int, ...], list[Exchange]] | None = None
        self.comm = CommCounter()
        super().__init__(groups, {**self._inner.defaults, "row_blocks": row_blocks})
        self._initial_options = []  # groups added later get the inner .defaults only

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        index = len(self.param_groups)
        if index < len(self._initial_options):  # one of the groups given at construction
            param_group = {**param_group, **self._initial_options[index]}
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        names = group.get("param_names")
        for i, param in enumerate(group["params"]):
            name = f"'{names[i]}'" if names else f"parameter {i} of param group {index}"
            resolved = resolve_param(param, name, self._cost, group["row_blocks"])
            self._resolved[id(param)] = resolved
            self._group_of[id(param)] = index
            if param.dim() == 3:
                self._stack_of.update((id(m.proxy), id(param)) for m in resolved.local)
            if resolved.tensor_parallel is not None:
                spec = resolved.tensor_parallel[0].params[resolved.tensor_parallel[1]].tp_spec
                local = local_of(param)
                self._tp[id(param)] = local.new_zeros(tuple(spec.shape))
        self._plan = None

    def comm_stats(self, reset: bool = False) -> dict[str, int]:
        """All-to-alls issued by ``step()`` and the bytes this rank sent and received."""
        stats = self.comm.as_dict()
        if reset:
            self.comm = CommCounter()
        return stats

    @property
    def inner(self) -> Optimizer:
        """The wrapped optimizer (its param groups hold this rank's proxies during a step)."""
        return self._inner

    # ------------------------------------------------------------------ plan
    def _exchanges(self) -> list[Exchange]:
        """Owners of every split matrix, fixed for the optimizer's life (the state lives
        there); a rank that owns one keeps a full proxy of it."""
        if self._plan is None:
            resolved = [self._resolved[id(p)] for g in self.param_groups for p in g["params"]]
            loads: dict[int, list[float]] = {}
            for r in resolved:
                if r.work is not None:
                    load = loads.setdefault(len(r.work), [0.0] * len(r.work))
                    loads[len(r.work)] = [a + b for a, b in zip(load, r.work)]
            remote = [r.remote for r in resolved if r.remote is not None]
            cost = self._cost
            self._plan = plan_exchanges(remote, lambda _t, shape: cost(shape), loads, who=WHO)
            self._owned = {}
            for exchange in self._plan:
                for unit in exchange.owned():
                    local = unit.target.param
                    proxy = torch.zeros(unit.shape, dtype=local.dtype, device=local.device)
                    self._owned[(id(local), unit.expert)] = proxy
                    if unit.expert is not None:
                        self._stack_of[id(proxy)] = id(local)
            self._outer = {id(r.remote.param): r.param for r in resolved if r.remote}
        return self._plan

    def _step_exchanges(self) -> list[Exchange]:
        """The exchanges of the parameters that have gradients this step (flexshard gives
        every rank of a shard group a gradient for the same parameters)."""
        plan = self._exchanges()
        key = tuple(id(u.target.param) for ex in plan for u in ex.units if self._has_grad(u))
        if self._step_plan is None or self._step_plan[0] != key:
            kept = [replace(ex, units=[u for u in ex.units if self._has_grad(u)]) for ex in plan]
            self._step_plan = (key, [ex for ex in kept if ex.units])
        return self._step_plan[1]

    def _has_grad(self, unit: Any) -> bool:
        return self._outer[id(unit.target.param)].grad is not None

    def _computed_here(self, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(state key, proxy) of every matrix of ``param`` this rank steps."""
        self._exchanges()
        resolved = self._resolved[id(param)]
        out = [(m.key, m.proxy) for m in resolved.local]
        if id(param) in self._tp:
            out.append(("matrix", self._tp[id(param)]))
        if resolved.remote is not None:
            local = resolved.remote.param
            out += [(state_key(e), p) for (i, e), p in self._owned.items() if i == id(local)]
        return out

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the inner step may drop gradients (heavyball does): note who had one first
        stepped_params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        exchanges = self._step_exchanges()
        # every bucket's forward all-to-all in flight at once, then the inner step over
        # the matrices this rank holds whole while they fly
        forwards = [self._send_forward(exchange) for exchange in exchanges]
        members = self._local_members()
        if self._overlap:  # then bucket by bucket: bucket k steps while k+1's gather flies
            groups = self._inner_step(members)
            self._release(members)
            backs = []
            for exchange, forward in zip(exchanges, forwards):
                owned = self._owned_members(exchange, forward)
                if owned:
                    groups = self._inner_step(owned)
                    self._release(owned)
                backs.append(self._send_back(exchange))
        else:  # ONE inner step (an optimizer may count its step() calls on itself, as
            # heavyball's schedules do), then every bucket's back all-to-all
            for exchange, forward in zip(exchanges, forwards):
                members += self._owned_members(exchange, forward)
            groups = self._inner_step(members)
            self._release(members)
            backs = [self._send_back(exchange) for exchange in exchanges]
        for param in stepped_params:
            if id(param) in self._tp:
                bucket, index = self._resolved[id(param)].tensor_parallel  # type: ignore[misc]
                local_of(param).copy_(own_part(bucket, index, self._tp[id(param)]))
        for exchange, back in zip(exchanges, backs):
            self._apply_remote(exchange, back)
        for group, inner_group in zip(self.param_groups, groups):  # e.g. a step counter
            group.update({k: v for k, v in inner_group.items() if k not in OWN_KEYS})
        self._record_state(stepped_params)
        return loss

    def _local_members(self) -> list[tuple[int, torch.Tensor]]:
        """(group index, proxy with its gradient) of every matrix this rank holds whole,
        and of every tensor-parallel matrix (gathered whole)."""
        members: list[tuple[int, torch.Tensor]] = []
        for group_index, group in enumerate(self.param_groups):
            for param in group["params"]:
                if param.grad is None:
                    continue
                for matrix in self._resolved[id(param)].local:
                    if matrix.proxy is not param:
                        matrix.proxy.grad = grad_view(param, matrix)
                    members.append((group_index, matrix.proxy))
                if id(param) in self._tp:
                    members.append((group_index, self._gather_tp(param)))
        return members

    def _owned_members(
        self, exchange: Exchange, forward: Transfer
    ) -> list[tuple[int, torch.Tensor]]:
        """The matrices of ``exchange`` this rank owns, assembled into their proxies."""
        members = []
        dtype = exchange.units[0].target.param.dtype
        for unit, full in zip(exchange.owned(), assemble(exchange, forward.wait(), 2, dtype)):
            proxy = self._owned[(id(unit.target.param), unit.expert)]
            proxy.copy_(full[1])
            proxy.grad = full[0]
            members.append((self._group_of[id(self._outer[id(unit.target.param)])], proxy))
        return members

    def _send_back(self, exchange: Exchange) -> Transfer:
        dtype = exchange.units[0].target.param.dtype
        updates = [self._owned[(id(u.target.param), u.expert)] for u in exchange.owned()]
        return send_updates(exchange, updates, self.comm, dtype)

    def _send_forward(self, exchange: Exchange) -> Transfer:
        """Gradient and parameter of every piece, as two channels in one all-to-all."""
        inputs = {}
        for unit in exchange.units:
            local = unit.target.param
            grad = local_of(self._outer[id(local)].grad)
            inputs[id(local)] = torch.stack([grad.reshape(-1).to(local.dtype), local.reshape(-1)])
        dtype = exchange.units[0].target.param.dtype
        return send_inputs(exchange, inputs, self.comm, 2, dtype)

    def _gather_tp(self, param: torch.Tensor) -> torch.Tensor:
        """The whole tensor-parallel matrix and its gradient on this rank (DistMuon's
        gather over dp, then tp): every rank steps the same copy, as one process would."""
        bucket, index = self._resolved[id(param)].tensor_parallel  # type: ignore[misc]
        proxy = self._tp[id(param)]
        assert param.grad is not None
        grad = gather_matrix(bucket, index, local_of(param.grad).to(proxy.dtype))
        proxy.copy_(gather_matrix(bucket, index, local_of(param)))
        proxy.grad = grad
        return proxy

    def _inner_step(self, members: list[tuple[int, torch.Tensor]]) -> list[dict[str, Any]]:
        """The inner step over ``members`` (group index, proxy with its gradient), its
        groups refreshed from the adapter's (lr schedulers edit those). The matrices of
        a stack with a batched step go in one call per stack, after the inner step has
        counted the step in each group, as it would with them in it."""
        stacks, members = self._stacks(members)
        groups = []
        for index, group in enumerate(self.param_groups):
            inner_group = {k: v for k, v in group.items() if k not in OWN_KEYS}
            inner_group["params"] = [p for i, p in members if i == index]
            groups.append(inner_group)
        self._inner.param_groups = groups
        self._inner.step()
        for (index, _), proxies in stacks.items():
            assert self._batched is not None
            self._batched(self._inner, groups[index], proxies)
        self._check_state()
        return groups

    def _stacks(
        self, members: list[tuple[int, torch.Tensor]]
    ) -> tuple[dict[tuple[int, int], list[torch.Tensor]], list[tuple[int, torch.Tensor]]]:
        """``members`` split into the proxies of each (group, 3-D stack) the batched
        step takes, and the rest (stepped one by one by the inner optimizer)."""
        if self._batched is None:
            return {}, members
        batched = self._batched
        takes: dict[tuple[int, int], bool] = {}  # per (group, stack), from its first matrix
        stacks: dict[tuple[int, int], list[torch.Tensor]] = {}
        rest = []
        for index, proxy in members:
            stack = self._stack_of.get(id(proxy))
            key = (index, stack if stack is not None else -1)
            if stack is not None and key not in takes:
                shape = tuple(proxy.shape)
                takes[key] = batched.accepts(self._inner, self.param_groups[index], shape)
            if stack is not None and takes[key]:
                stacks.setdefault(key, []).append(proxy)
            else:
                rest.append((index, proxy))
        return stacks, rest

    def _release(self, members: list[tuple[int, torch.Tensor]]) -> None:
        for index, proxy in members:
            if not any(proxy is p for p in self.param_groups[index]["params"]):
                proxy.grad = None

    def _apply_remote(self, exchange: Exchange, back: Transfer) -> None:
        for _unit, _piece, part, value in local_updates(exchange, back.wait()):
            part.copy_(value)

    def _check_state(self) -> None:
        """The inner state must be keyed by proxies: state kept on anything else is not
        per-matrix and would be silently wrong on shards."""
        proxies = {id(p) for r in self._resolved.values() for m in r.local for p in [m.proxy]}
        proxies |= {id(p) for p in self._owned.values()} | {id(p) for p in self._tp.values()}
        for key in self._inner.state:
            if id(key) not in proxies:
                raise ValueError(
                    f"MatrixOptimizer: {self._tag} keeps state under {type(key).__name__} "
                    f"{getattr(key, 'shape', key)!r}, not under one of its parameters; only "
                    "optimizers whose state is per matrix can run on sharded storage"
                )

    def _record_state(self, params: list[torch.Tensor]) -> None:
        """Expose each matrix's inner state in ``self.state`` (what checkpoints read)."""
        for param in params:
            entry = self.state[param]
            entry["inner"] = self._tag  # on every rank, so no rank's state is empty
            for key, proxy in self._computed_here(param):
                inner = self._inner.state.get(proxy)
                if inner and not (key in entry and entry[key].state is inner):
                    entry[key] = MatrixState(inner)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict: each rank's own matrices (``MatrixState``), or, inside
        torch's ``get_optimizer_state_dict(full_state_dict=True)``, every matrix as a
        plain dict (see :mod:`.matrix_state_dict`)."""
        out = super().state_dict()
        call = full_state_dict_call()
        if call is None:
            return out
        params = [p for g in self.param_groups for p in g["params"]]
        names = [self._resolved[id(p)].name for p in params]
        devices = [local_of(p).device for p in params]
        return full_state(out, call, names, devices, self._tag)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved at any world size and placement, sharded (``MatrixState``
        per matrix) or full (plain dicts), keyed by position or by torch's FQNs: each
        rank keeps the matrices it computes now. Raises naming the parameter for state
        of another inner optimizer or a missing matrix, before anything changes."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError(
                f"MatrixOptimizer: the state has {len(saved_ids)} parameters, this "
                f"optimizer {len(params)}"
            )
        by_id = dict(zip(saved_ids, params))  # as torch maps them: by position in the groups
        restored: dict[int, dict[str, Any]] = {}
        inner: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        for saved_id, entries in state_dict["state"].items():
            param = by_id[saved_id]
            name = self._resolved[id(param)].name
            if entries.get("inner") != self._tag:
                raise ValueError(
                    f"MatrixOptimizer: the state of {name} was made by "
                    f"{entries.get('inner')!r}; this optimizer runs {self._tag}"
                )
            kept: dict[str, Any] = {"inner": self._tag}
            for key, proxy in self._computed_here(param):
                saved = saved_matrix(entries.get(key))
                if saved is None:
                    raise ValueError(f"MatrixOptimizer: no state '{key}' for {name}")
                moved = {
                    k: v.to(proxy.device) if isinstance(v, torch.Tensor) else v
                    for k, v in saved.items()
                }
                kept[key] = MatrixState(moved)
                inner[id(proxy)] = (proxy, moved)
            restored[id(param)] = kept
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._inner.state.clear()
        for proxy, moved in inner.values():
            self._inner.state[proxy] = moved
        for param in params:
            if id(param) in restored:
                self.state[param] = restored[id(param)]
