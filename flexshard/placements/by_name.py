"""A bucket's placement policy given as a table, parameter FQN -> Placement: what a
planner decided (muon_buckets' owner of each matrix), shown whole by ``repr``."""

from __future__ import annotations

from collections.abc import Mapping

from .base import Placement


class PlacementByName:
    """``placement(fqn, param)`` for a ``BucketSpec``: each parameter's placement looked
    up by FQN. Compares by identity, as the function it stands in for would."""

    def __init__(self, table: Mapping[str, Placement]) -> None:
        self.table = dict(table)

    def __call__(self, fqn: str, param: object) -> Placement:
        try:
            return self.table[fqn]
        except KeyError:
            raise KeyError(f"no placement was planned for parameter '{fqn}'") from None

    def __repr__(self) -> str:
        entries = ", ".join(f"{fqn!r}: {placement!r}" for fqn, placement in self.table.items())
        return f"PlacementByName({{{entries}}})"
