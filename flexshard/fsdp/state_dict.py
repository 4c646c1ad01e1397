"""Full (unsharded) state dicts: gather for export, scatter-free load for import.

``module.state_dict()`` / ``load_state_dict`` of a sharded module.

``state_dict()`` gives the sharded parameters as the DTensors they are (FSDP2 does
the same): ``dcp.save`` writes this rank's chunks straight from them, ``dcp.load``
reads into them in place. ``load_state_dict`` accepts those, RegionTensors, or full
tensors, and copies this rank's regions into the storage; parameters assigned by
``load_state_dict(assign=True)`` are re-adopted into the storage afterwards.

Initialise a sharded (e.g. meta-built) model with the values it would have whole."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.bucket import Bucket
from ..runtime.dtensor.chunks import RegionTensor, local_boxes, shifted
from ..runtime.dtensor.region_dtensor import wrap
from ..runtime.dtensor.tensor_parallel import global_tensor, local_piece, tp_frame
from ..runtime.module import own_buckets, subtree_buckets


def param_index(module: nn.Module) -> dict[int, tuple[Bucket, int]]:
    """Local and full parameter objects -> (bucket, index), for every bucket below."""
    index = {}
    for bucket in subtree_buckets(module):
        for i, (local, full) in enumerate(zip(bucket.local_params, bucket.full_params)):
            index[id(local)] = index[id(full)] = (bucket, i)
    return index


#: ``full_state_dict``'s hook: this rank's gathered state in, the whole model's out
Assemble = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def full_state_dict(module: nn.Module, assemble: Assemble | None = None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as the unsharded model would give it. Every rank of the
    shard groups must call it (one all-gather per bucket; a DTensor no bucket stores,
    such as FSDP2's, through its ``full_tensor``); every rank gets it all.

    ``assemble``: for a module that is one part of a larger model (expert slices of
    expert parallelism, a pipeline stage), called with the gathered state on every
    rank; what it returns, the whole model's tensors by name, is the result. It may
    communicate: every rank calls it."""
    index = param_index(module)
    gathered: dict[int, list[torch.Tensor]] = {}
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        entry = index.get(id(value))
        if entry is None:
            value = value.detach()
            out[key] = value.full_tensor() if isinstance(value, DTensor) else value
            continue
        bucket, i = entry
        if id(bucket) not in gathered:
            gathered[id(bucket)] = bucket.gather_full()
        spec = bucket.params[i].tp_spec
        full = gathered[id(bucket)][i]
        # a TP parameter: the gathered tensor is this tp rank's piece; join the pieces
        out[key] = full if spec is None else global_tensor(full, spec)
    return out if assemble is None else assemble(out)


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Load an unsharded state dict: each rank copies out the regions it stores. No
    collective; every key and shape is checked before anything is changed."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_full_state_dict: state_dict must be a mapping of name -> tensor, got "
            f"{type(state_dict).__name__}"
        )
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state dict entry '{key}' must be a tensor, got {type(value).__name__}"
            )
    index = param_index(module)
    if not index:
        raise ValueError("load_full_state_dict needs a module sharded by flexshard")
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(
            f"state dict does not match the model: missing {missing}, unexpected {unexpected}"
        )
    updates: dict[int, tuple[Bucket, list[torch.Tensor | None]]] = {}
    buffers = {}
    for key, value in own.items():
        if key not in state_dict:
            continue
        source = state_dict[key]
        entry = index.get(id(value))
        spec = entry[0].params[entry[1]].tp_spec if entry else None
        shape = tuple(value.shape)
        if entry is not None:
            shape = tuple(spec.shape if spec else entry[0].layout.params[entry[1]].shape)
        if tuple(source.shape) != shape:
            raise ValueError(
                f"state dict entry '{key}' has shape {tuple(source.shape)}, "
                f"the model expects {shape}"
            )
        if entry is None:
            buffers[key] = source
            continue
        bucket, i = entry
        fulls = updates.setdefault(id(bucket), (bucket, [None] * len(bucket.params)))[1]
        # a TP parameter: this tp rank stores its piece of the whole tensor
        fulls[i] = source if spec is None else local_piece(source, spec)
    for bucket, fulls in updates.values():
        device = bucket.storage.device
        bucket.load_full([None if f is None else f.to(device) for f in fulls])
    with torch.no_grad():
        for key, source in buffers.items():
            own[key].copy_(source)


Slot = tuple[Bucket, int]


def sharded_keys(module: nn.Module, buckets: list[Bucket]) -> list[tuple[list[str], Slot]]:
    """Every state-dict key (relative to ``module``) of each parameter of ``buckets``:
    tied parameters have several, the first is the one ``named_parameters`` gives."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    entries = []
    for bucket in buckets:
        for i, param in enumerate(bucket.params):
            keys = []
            for owner, attr in param.locations:
                prefix = names.get(id(owner))
                if prefix is not None:
                    keys.append(f"{prefix}.{attr}" if prefix else attr)
            entries.append((keys, (bucket, i)))
    return entries


def to_local(value: torch.Tensor, bucket: Bucket, index: int, key: str) -> torch.Tensor:
    """This rank's local tensor of parameter ``index`` from a DTensor, a RegionTensor or
    a full tensor."""
    param = bucket.layout.params[index]
    shape = param.local_shape(bucket.store.rank)
    boxes = local_boxes(param, bucket.store.rank)
    expected = tuple(param.shape)
    spec = bucket.params[index].tp_spec
    if spec is not None:  # a tensor-parallel piece: boxes in the whole tensor's coordinates
        expected, offset, _ = tp_frame(spec)
        boxes = shifted(boxes, offset)
    # a DTensor's shape is global: checked before its local tensor is taken as the shard
    if tuple(value.shape) != expected:
        raise ValueError(
            f"state dict entry '{key}' has shape {tuple(value.shape)}, bucket "
            f"'{bucket.name}' expects {expected}"
        )
    if isinstance(value, DTensor):
        if value.placements != bucket.specs[index].placements:
            value = value.full_tensor()  # placed otherwise: every rank gathers, then cuts
        else:
            return value.to_local()
    if isinstance(value, RegionTensor):
        if [box for box, _ in value.pieces] != boxes:
            raise ValueError(
                f"state dict entry '{key}' describes other chunks than bucket '{bucket.name}' "
                f"stores on rank {bucket.store.rank}; build it with this model's state_dict()"
            )
        return value.local().view(shape)
    if not boxes:
        return value.new_empty(shape)
    pieces = [value[tuple(slice(o, o + s) for o, s in zip(*box))].reshape(-1) for box in boxes]
    return torch.cat(pieces).view(shape)


def _own_buckets(module: nn.Module) -> list[Bucket]:
    return own_buckets(module)


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
    buckets = _own_buckets(module)
    for bucket in buckets:
        bucket.reshard()  # the modules hold the local parameters the values copy into
    for keys, (bucket, i) in sharded_keys(module, buckets):
        for key in keys:
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor):
                local = to_local(value, bucket, i, prefix + key)
                state_dict[prefix + key] = wrap(local, bucket.specs[i])


def _load_post_hook(module: nn.Module, _incompatible: Any) -> None:
    """``load_state_dict(assign=True)`` put new parameter objects on the modules:
    move their values into the bucket storage and make them its views again."""
    for bucket in _own_buckets(module):
        bucket.adopt_replaced()


def _save_pre_hook(module: nn.Module, *_args: Any) -> None:
    """``state_dict()`` gives the sharded parameters, also right after a forward that
    kept them gathered (``reshard_after_forward=False``): reshard first, as FSDP2 does."""
    for bucket in _own_buckets(module):
        bucket.reshard()


def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``state_dict`` give the sharded parameters, ``load_state_dict`` accept
    DTensors, RegionTensors and full tensors, and re-adopt assigned parameters."""
    module.register_state_dict_pre_hook(_save_pre_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)
    module.register_load_state_dict_post_hook(_load_post_hook)


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def init_params(module: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Run ``init_fn(submodule)`` (default ``submodule.reset_parameters()``) on every
    submodule that directly holds sharded parameters, in module order, each on
    full-size temporaries of its own parameters, and keep this rank's regions.

    The random stream is consumed as when the whole model is initialised module by
    module, so after ``torch.manual_seed(s)`` every rank stores exactly the regions a
    single process would have built with the same seed. Needs no collective; peak
    extra memory is one module's parameters.
    """
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_params: init_fn must be callable or None, got {init_fn!r}")
    index = param_index(module)
    if not index:
        raise ValueError("init_params needs a module sharded by flexshard")
    # a tied parameter's temporary, kept for its later holders: each starts from what
    # the earlier ones drew, as on a whole model (the last draw wins, an init that
    # skips the parameter keeps it)
    drawn: dict[int, nn.Parameter] = {}
    holders = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for sub in module.modules():
        own = [(name, p) for name, p in sub._parameters.items() if id(p) in index]
        if not own or (init_fn is None and not hasattr(sub, "reset_parameters")):
            continue
        temporaries = {}
        for name, local in own:
            if id(local) in drawn:
                temporaries[name] = sub._parameters[name] = drawn[id(local)]
                continue
            bucket, i = index[id(local)]
            spec = bucket.params[i].tp_spec  # a TP piece: initialise the whole tensor
            shape = bucket.layout.params[i].shape if spec is None else spec.shape
            full = torch.empty(shape, dtype=bucket.store.dtypes[i], device=bucket.storage.device)
            temporaries[name] = nn.Parameter(full, requires_grad=local.requires_grad)
            sub._parameters[name] = temporaries[name]
            if holders[id(local)] > 1:
                drawn[id(local)] = temporaries[name]
        try:
            with torch.no_grad():
                (init_fn or _reset)(sub)
        finally:
            for name, local in own:
                sub._parameters[name] = local
        for name, local in own:
            bucket, i = index[id(local)]
            fulls: list[torch.Tensor | None] = [None] * len(bucket.params)
            spec = bucket.params[i].tp_spec
            full = temporaries[name].detach()
            fulls[i] = full if spec is None else local_piece(full, spec)
            bucket.load_full(fulls)
