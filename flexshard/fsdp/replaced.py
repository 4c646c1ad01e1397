"""Parameters that sharding replaced.

``flex_shard`` and ``fully_shard`` set new parameter objects (DTensors over bucket
storage) on the modules, as FSDP2 does; a parameter collected before sharding is no
longer the model's and would silently never be trained. flexshard marks the replaced
objects so its optimizers can refuse them, naming the parameter, at construction."""

from __future__ import annotations

import torch
from torch import nn

_MARK = "_flexshard_replaced_by"


def mark_replaced(members: list[tuple[nn.Parameter, list[str]]], bucket: str, call: str) -> None:
    """Mark the pre-sharding parameters of one bucket (called once it is built)."""
    for param, fqns in members:
        setattr(param, _MARK, f"'{fqns[0]}' (replaced by {call}, bucket '{bucket}')")


def check_not_replaced(param: torch.Tensor, who: str) -> None:
    """Raise naming ``param`` if sharding replaced it: it is not the model's anymore."""
    where = getattr(param, _MARK, None)
    if where is not None:
        raise ValueError(
            f"{who}: parameter {where} was collected before sharding; the model holds a "
            "new parameter now and this one would never be trained. Build the optimizer "
            "after flex_shard / fully_shard, from model.parameters()"
        )
