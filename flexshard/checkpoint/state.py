"""A model's and its optimizer's checkpoint state: torch's DCP state-dict API.

``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``)
work on flexshard modules as on FSDP2's: ``state_dict()`` gives the sharded parameters
as DTensors (RegionDTensors for FlatShard, Owned and BlockShard, which tell DCP the
chunks this rank stores), an optimizer's state is placed like its parameter (or is a
per-matrix ``MatrixState`` that DCP pickles once), so ``dcp.save`` writes each chunk
once and ``dcp.load`` reshards. What this module adds to torch's API:

* one root over several modules of one logical model (``logical_model.logical_root``);
* param groups naming every rank's parameters (``gathers``): the nested form lists a
  rank's own and DCP keeps one rank's list of each group, so ranks holding different
  parameters (pipeline stages) save the union;
* a parameter the optimizer holds and the model does not, named (torch: a KeyError);
* for loading: fresh copies to read into (``fresh``: checked, then applied, so a bad
  checkpoint changes nothing) and the saved optimizer form read from the checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..runtime.module import subtree_buckets
from .bounded import Ranks
from .logical_model import Model, logical_root, modules_of

State = dict[str, Any]


def _check_optimizer(root: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    known = {id(p) for p in root.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"optimizer param group {g} holds a parameter of shape {tuple(p.shape)} "
                    "that is not in the model; build the optimizer after sharding, from "
                    "model.parameters()"
                )


def _options(flat: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def state_dict(
    model: Model, optimizer: torch.optim.Optimizer | None = None, *, flat: bool = False
) -> State:
    """``{"model": ..., "optim": ...}``: torch's ``get_state_dict`` of ``model`` (one
    module, or the modules of one logical model) and ``optimizer``; ``flat``: the
    optimizer's state flattened per parameter (torch's ``flatten_optimizer_state_dict``).
    An optimizer without state is first given it (torch: one zero-gradient, lr-0 step)."""
    for module in modules_of(model):
        for bucket in subtree_buckets(module):
            # torch maps the optimizer's parameters by name before state_dict() (whose
            # hook reshards): a bucket left gathered holds full parameters on the modules
            bucket.reshard()
    root = logical_root(model)
    if optimizer is None:
        return {"model": get_model_state_dict(root)}
    _check_optimizer(root, optimizer)
    model_state, optim_state = get_state_dict(root, optimizer, options=_options(flat))
    return {"model": model_state, "optim": optim_state}


def apply(model: Model, optimizer: torch.optim.Optimizer | None, state: State) -> None:
    """``state`` (as ``state_dict`` gives it, nested or flattened, loaded) into
    ``model`` and ``optimizer``: torch's ``set_model_state_dict`` (strict) and
    ``set_optimizer_state_dict``, which takes parameters without state (the
    ``without_unsaved_state`` ones: every other key was checked against the checkpoint
    before the read, and the param groups after it)."""
    root = logical_root(model)
    set_model_state_dict(root, state["model"])
    if optimizer is not None:
        lenient = StateDictOptions(strict=False)
        set_optimizer_state_dict(root, optimizer, state["optim"], options=lenient)


def optimizer_state_dict(model: Model, optimizer: torch.optim.Optimizer) -> State:
    """The optimizer's state keyed by parameter FQN, ready for ``dcp.save`` /
    ``dcp.load``: torch's ``get_optimizer_state_dict`` (state tensors placed like their
    parameter)."""
    return state_dict(model, optimizer)["optim"]


def load_optimizer_state_dict(
    model: Model, optimizer: torch.optim.Optimizer, state_dict: State
) -> None:
    """An ``optimizer_state_dict``-shaped dict (after ``dcp.load``) into ``optimizer``:
    torch's ``set_optimizer_state_dict``. A full (unsharded) dict goes through torch's
    ``full_state_dict=True`` option instead."""
    set_optimizer_state_dict(logical_root(model), optimizer, state_dict)


def gathers(model: Model, stages: bool = False) -> bool:
    """Whether the param groups saved name every rank's parameters (one all-gather).
    ``stages``: ranks hold different parameters (pipeline stages). A flexshard model's
    always do: the format of flexshard's checkpoints, whose ``save`` may be given any
    split of a model; torch's own nested lists stay for FSDP2 modules otherwise."""
    modules = modules_of(model)
    return stages or len(modules) > 1 or any(any(subtree_buckets(m)) for m in modules)


def group_params(optim: State) -> list[list[str]]:
    """The FQNs of each param group (nested form)."""
    return [list(group["params"]) for group in optim["param_groups"]]


def union_groups(groups: list[list[str]], ranks: Ranks) -> list[list[str]]:
    """Each param group's FQNs over every rank."""
    every = ranks.all_gather(groups, "param-group all-gather")
    if len({len(g) for g in every}) != 1:
        raise ValueError(
            f"the ranks' optimizers have different numbers of param groups "
            f"{[len(g) for g in every]}; a checkpoint needs the same groups on every rank"
        )
    return [list(dict.fromkeys(f for part in every for f in part[i])) for i in range(len(groups))]


def with_groups(state: State, groups: list[list[str]]) -> State:
    """``state`` with its param groups listing ``groups``' FQNs."""
    optim = state["optim"]
    merged = [{**g, "params": fqns} for g, fqns in zip(optim["param_groups"], groups)]
    return {**state, "optim": {**optim, "param_groups": merged}}


def group_problems(mine: list[list[str]], saved: list[list[str]]) -> list[str]:
    """The saved param groups against every rank's groups together (``mine``)."""
    if sorted(map(sorted, mine)) == sorted(map(sorted, saved)):
        return []
    return [
        "optimizer state does not match the optimizer: param groups of "
        f"{[len(g) for g in mine]} parameters over all ranks, the checkpoint has "
        f"{[len(g) for g in saved]} (or other parameter names)"
    ]


def saved_entries(metadata: Metadata) -> set[str]:
    """The top-level entries a checkpoint holds ("model", "optim", ...)."""
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def without_unsaved_state(optim: State, metadata: Metadata) -> State:
    """``optim`` (nested: a fresh optimizer's state, which torch gives every parameter)
    less the parameters the checkpoint holds no state for: parameters the saved
    optimizer never stepped, because no gradient ever reached them (DeepSeek-V4's
    indexer, chosen by a top-k). They load without state, as they were saved; the
    param groups are checked after the read, so a parameter the saved optimizer did not
    know still raises."""
    held = set()  # every dotted prefix of the saved optimizer-state keys
    for key in metadata.state_dict_metadata:
        if key.startswith("optim.state."):
            parts = key.split(".")
            held.update(".".join(parts[:n]) for n in range(3, len(parts)))
    state = {fqn: v for fqn, v in optim["state"].items() if f"optim.state.{fqn}" in held}
    return {**optim, "state": state}


def saved_flat(metadata: Metadata) -> bool:
    """Whether its optimizer state is torch's flattened form (FSDP2 pipeline
    checkpoints: "optim.param_groups.<fqn>.lr" rather than numbered groups)."""
    paths = (metadata.planner_data or {}).values()
    return any(path[0] == "optim" and len(path) == 2 for path in paths)


def fresh(value: Any) -> Any:
    """A copy to load into: tensors cloned (a DTensor keeps its placement), containers
    rebuilt, anything else as it is (DCP replaces it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fresh(v) for v in value]
    return value
