"""Traffic besides the buckets': collectives that code around a sharded model issues
itself (the trainer's expert-parallel all-to-alls, context-parallel K/V exchanges)
and wants counted in ``FlexShardModule.comm_stats()``.

``attach_traffic(module, kind, stats)`` hangs a ``TrafficStats`` on ``module``; every
flexshard module at or above ``module`` then reports the sum of its subtree's stats of
that ``kind`` as ``comm_stats()[kind]``, adds it to ``"total"`` and resets it with
``reset=True``. Whoever issues the collectives ``record``\\ s them on the stats (this
module imports nothing of theirs: the dependency stays one way).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import nn

from .collectives import CommStats

#: what ``TrafficStats.record`` counts, one call each
TRAFFIC_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
_ATTR = "_flexshard_traffic"  # module attribute: {kind: [TrafficStats, ...]}


@dataclass
class TrafficStats(CommStats):
    """A bucket's ``CommStats`` keys plus ``all_to_all`` and ``send_recv`` (a send and a
    receive issued together: one call). ``all_gather_bytes`` (parameter all-gathers)
    stays 0: none of this is a parameter gather. Bytes: what this rank sent and
    received, counted by the caller (the ring algorithm's ``(W - 1)`` chunks for an
    all-gather or reduce-scatter, as the buckets do)."""

    all_to_all: int = 0
    send_recv: int = 0

    @property
    def collectives(self) -> int:
        return super().collectives + self.all_to_all + self.send_recv

    def as_dict(self) -> dict[str, int]:
        return {**super().as_dict(), "all_to_all": self.all_to_all, "send_recv": self.send_recv}

    def record(self, collective: str, sent: int, received: int) -> None:
        """One ``collective`` (a name of ``TRAFFIC_COLLECTIVES``) that sent ``sent`` and
        received ``received`` bytes on this rank."""
        if collective not in TRAFFIC_COLLECTIVES:
            raise ValueError(
                f"TrafficStats.record: collective {collective!r} must be one of "
                f"{TRAFFIC_COLLECTIVES}"
            )
        if sent < 0 or received < 0:
            raise ValueError(f"TrafficStats.record: negative bytes ({sent}, {received})")
        setattr(self, collective, getattr(self, collective) + 1)
        self.bytes_sent += sent
        self.bytes_received += received

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)


def attach_traffic(module: nn.Module, kind: str, stats: TrafficStats) -> None:
    """Report ``stats`` as part of ``comm_stats()[kind]`` of every flexshard module at
    or above ``module`` (attach before or after sharding; once per ``stats``)."""
    if not isinstance(stats, TrafficStats):
        raise TypeError(f"attach_traffic: stats must be a TrafficStats, got {stats!r}")
    if not kind or kind == "total":
        raise ValueError(f"attach_traffic: kind {kind!r} is not a usable comm_stats key")
    attached: dict[str, list[TrafficStats]] = module.__dict__.setdefault(_ATTR, {})
    entries = attached.setdefault(kind, [])
    if not any(s is stats for s in entries):
        entries.append(stats)


def subtree_traffic(module: nn.Module) -> dict[str, list[TrafficStats]]:
    """Every ``TrafficStats`` attached at or below ``module``, once each, by kind (in
    module order)."""
    out: dict[str, list[TrafficStats]] = {}
    seen: set[int] = set()
    for sub in module.modules():
        for kind, entries in sub.__dict__.get(_ATTR, {}).items():
            for stats in entries:
                if id(stats) not in seen:
                    seen.add(id(stats))
                    out.setdefault(kind, []).append(stats)
    return out


def summed(entries: list[TrafficStats]) -> dict[str, int]:
    """One ``comm_stats`` entry: the ``as_dict`` of ``entries`` added key by key."""
    total = TrafficStats().as_dict()
    for stats in entries:
        for key, value in stats.as_dict().items():
            total[key] += value
    return total
