"""Optimizer state keyed by parameter FQN, in the shape of torch's ``get_optimizer_state_dict``.

``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``: state
tensors shaped like a sharded parameter's local shard are RegionTensors with the
parameter's chunks, so DCP writes each rank's part once and reshards on load; scalars
(``step``) stay plain. A torch FSDP2 model's optimizer state has the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..runtime.region_dtensor import wrap
from ..state_dict_hooks import Slot, fqn_slots, slot_tensor, to_local
from ..torch_internals import init_optim_state

OptimizerState = dict[str, Any]
#: one module, or the modules of one logical model under their global FQNs (the
#: pipeline stages a rank runs)
Model = nn.Module | Sequence[nn.Module]


def modules_of(model: Model) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def param_names(model: Model) -> tuple[dict[int, str], dict[str, Slot]]:
    """id(local parameter) -> canonical FQN, and FQN -> bucket slot for sharded ones."""
    names: dict[int, str] = {}
    slots: dict[str, Slot] = {}
    for module in modules_of(model):
        mine = fqn_slots(module)
        names.update({id(p): n for n, p in module.named_parameters()})
        for fqn, (bucket, i) in mine.items():
            names[id(bucket.local_params[i])] = fqn
        slots.update(mine)
    return names, slots


def _group_fqns(model: Model, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names, _ = param_names(model)
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {g} holds a parameter of shape {tuple(p.shape)} "
                    "that is not in the model; build the optimizer after sharding, from "
                    "model.parameters()"
                )
            fqns.append(names[id(p)])
        groups.append(fqns)
    return groups


def is_sharded_state(value: object, local: torch.Tensor) -> bool:
    """A state tensor laid out like the local shard (exp_avg, momentum), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape


def optimizer_state_dict(model: Model, optimizer: torch.optim.Optimizer) -> OptimizerState:
    """The optimizer's state, ready for ``dcp.save`` / ``dcp.load``. Like torch's
    ``get_optimizer_state_dict``, an optimizer without state is first given it (one
    ``step`` with zero gradients and lr 0), so ``dcp.load`` has tensors to fill."""
    groups = _group_fqns(model, optimizer)
    init_optim_state(optimizer)
    _, slots = param_names(model)
    state: dict[str, dict[str, Any]] = {}
    for group, fqns in zip(optimizer.param_groups, groups):
        for param, fqn in zip(group["params"], fqns):
            entries = {}
            for name, value in optimizer.state.get(param, {}).items():
                if fqn in slots and is_sharded_state(value, param):
                    entries[name] = slot_tensor(*slots[fqn], value)
                else:
                    entries[name] = value
            if entries:
                state[fqn] = entries
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": fqns}
        for group, fqns in zip(optimizer.param_groups, groups)
    ]
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state_dict(
    model: Model, optimizer: torch.optim.Optimizer, state_dict: OptimizerState
) -> None:
    """Load an ``optimizer_state_dict``-shaped dict (RegionTensors after ``dcp.load``,
    or full tensors from an unsharded model) into ``optimizer``. Everything is checked
    and converted before the optimizer changes."""
    optimizer.load_state_dict(prepare_optimizer_state(model, optimizer, state_dict))


def prepare_optimizer_state(
    model: Model, optimizer: torch.optim.Optimizer, state_dict: OptimizerState
) -> dict[str, Any]:
    """``state_dict`` checked and converted to what ``optimizer.load_state_dict``
    takes (local tensors, parameters by position); changes nothing."""
    groups = _group_fqns(model, optimizer)
    saved_groups = state_dict.get("param_groups", [])
    if [sorted(g) for g in groups] != [sorted(g.get("params", [])) for g in saved_groups]:
        raise ValueError(
            "optimizer state does not match the optimizer: param groups "
            f"{[len(g) for g in groups]} parameters here, the state has "
            f"{[len(g.get('params', [])) for g in saved_groups]} "
            "(or other parameter names)"
        )
    _, slots = param_names(model)
    local_of = {
        fqn: p
        for group, fqns in zip(optimizer.param_groups, groups)
        for p, fqn in zip(group["params"], fqns)
    }
    index_of = {fqn: i for i, fqn in enumerate(f for g in groups for f in g)}
    state = {}
    for fqn, entries in state_dict.get("state", {}).items():
        if fqn not in index_of:
            raise ValueError(f"optimizer state for '{fqn}', which the optimizer does not hold")
        local = local_of[fqn]
        converted = {}
        for name, value in entries.items():
            key = f"state.{fqn}.{name}"
            if fqn in slots and isinstance(value, torch.Tensor) and value.dim() > 0:
                bucket, i = slots[fqn]  # placed like the parameter, as the optimizer made it
                value = wrap(to_local(value, bucket, i, key), bucket.specs[i])
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != local.shape:
                raise ValueError(
                    f"optimizer state '{key}' has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(local.shape)}"
                )
            converted[name] = value
        state[index_of[fqn]] = converted
    # torch matches groups by position: give each saved group's settings in our order
    by_params = {tuple(sorted(g["params"])): g for g in saved_groups}
    param_groups = []
    for fqns in groups:
        saved = by_params[tuple(sorted(fqns))]
        param_groups.append(
            {
                **{k: v for k, v in saved.items() if k != "params"},
                "params": [index_of[f] for f in fqns],
            }
        )
    return {"state": state, "param_groups": param_groups}
