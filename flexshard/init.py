"""Initialise a sharded (e.g. meta-built) model with the values it would have whole."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .runtime.tp_params import local_piece
from .state_dict import param_index


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
    for sub in module.modules():
        own = [(name, p) for name, p in sub._parameters.items() if id(p) in index]
        if not own or (init_fn is None and not hasattr(sub, "reset_parameters")):
            continue
        temporaries = {}
        for name, local in own:
            bucket, i = index[id(local)]
            spec = bucket.params[i].tp_spec  # a TP piece: initialise the whole tensor
            shape = bucket.layout.params[i].shape if spec is None else spec.shape
            full = torch.empty(shape, dtype=bucket.dtypes[i], device=bucket.storage.device)
            temporaries[name] = nn.Parameter(full, requires_grad=local.requires_grad)
            sub._parameters[name] = temporaries[name]
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
