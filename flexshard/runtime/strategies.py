"""Which ``Collective`` a bucket uses: chosen once, when the bucket is built.

A placement names its collective in its ``collective`` attribute, a quantization
format in its own (placements and formats are pure layout math below the runtime,
so they name it, or hand over a factory, rather than import it). A new placement or
format brings its own collective with ``register_collective(name, factory)`` and
``collective = name`` on its class; the runtime needs no change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..placements import Placement
from ..quant import QuantFormat
from .gather import BytesGather, Collective, PlainGather, RaggedGather, ReplicatedGather
from .quantized import QuantizedGather
from .storage import BucketStorage

#: builds a bucket's collective from its storage and quantization format (or None)
CollectiveFactory = Callable[[BucketStorage, "QuantFormat | None"], Collective]


def _sharded(store: BucketStorage, fmt: QuantFormat | None) -> Collective:
    # one storage dtype: gather elements (per-rank sizes when ragged); several: the
    # storage is bytes
    if store.packed:
        return BytesGather(store)
    return RaggedGather(store) if store.layout.ragged else PlainGather(store)


def _quantized(store: BucketStorage, fmt: QuantFormat | None) -> Collective:
    assert fmt is not None
    return QuantizedGather(store, fmt)


_COLLECTIVES: dict[str, CollectiveFactory] = {
    "sharded": _sharded,
    "replicated": lambda store, fmt: ReplicatedGather(store),
    "quantized": _quantized,
}


def register_collective(name: str, factory: CollectiveFactory) -> None:
    """Make ``name`` usable as a placement's or format's ``collective``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_collective: name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_collective: factory for '{name}' must be callable")
    _COLLECTIVES[name] = factory


def _factory(named: object, bucket: str, owner: str) -> CollectiveFactory:
    if callable(named):
        return named  # type: ignore[return-value]
    if isinstance(named, str) and named in _COLLECTIVES:
        return _COLLECTIVES[named]
    raise ValueError(
        f"bucket '{bucket}': {owner} names collective {named!r}, which is not registered "
        f"(known: {sorted(_COLLECTIVES)}; add one with flexshard.runtime.strategies."
        "register_collective)"
    )


def choose_collective(
    bucket: str,
    fqns: Sequence[str],
    placements: Sequence[Placement],
    quant: QuantFormat | None,
    store: BucketStorage,
) -> Collective:
    """The bucket's collective: its quantization format's, else the one its
    placements name (all of them alike: one bucket moves with one collective)."""
    if quant is not None:
        named = getattr(quant, "collective", "quantized")
        return _factory(named, bucket, f"format {quant}")(store, quant)
    names = [getattr(p, "collective", "sharded") for p in placements]
    for fqn, name in zip(fqns, names):
        if name != names[0]:
            raise ValueError(
                f"bucket '{bucket}': parameter '{fqns[0]}' names collective {names[0]!r} "
                f"but parameter '{fqn}' names {name!r}; one bucket moves with one "
                "collective: give them buckets of their own"
            )
    owner = f"parameter '{fqns[0]}'" if fqns else "the bucket"
    return _factory(names[0] if names else "sharded", bucket, owner)(store, None)
