"""One module over the modules of one logical model, for torch's DCP state-dict API.

``get_state_dict`` / ``set_state_dict`` take one root module. A rank running several
pipeline stages holds several, each a shell of the whole model keeping its global FQNs
(``layers.5.attention...``). ``logical_root`` gives torch one module over them: their
submodules merged by name, so every FQN resolves as in the whole model, while
``state_dict`` / ``load_state_dict`` go to each stage module itself, so its own hooks
run (flexshard's reshard and DTensor conversion, FSDP2's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from torch import nn

#: one module, or the modules of one logical model under their global FQNs (the
#: pipeline stages a rank runs)
Model = nn.Module | Sequence[nn.Module]


def modules_of(model: Model) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def logical_root(model: Model) -> nn.Module:
    """``model`` itself, or one module over the several given."""
    modules = modules_of(model)
    return modules[0] if len(modules) == 1 else _Stages(modules)


class _Keys(NamedTuple):  # what nn.Module.load_state_dict returns
    missing_keys: list[str]
    unexpected_keys: list[str]


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _merge(target: nn.Module, sources: list[nn.Module]) -> None:
    """``sources``' parameters, buffers and (stateful) submodules by name into
    ``target``: a submodule one source has is taken as it is, one several have (the
    stages' ``layers``) becomes a container merging theirs."""
    children: dict[str, list[nn.Module]] = {}
    for source in sources:
        for name, param in source.named_parameters(recurse=False):
            target.register_parameter(name, param)
        for name, buffer in source.named_buffers(recurse=False):
            persistent = name not in source._non_persistent_buffers_set
            target.register_buffer(name, buffer, persistent=persistent)
        for name, child in source.named_children():
            if _has_state(child):  # a stage's stand-in (nn.Identity) has none
                children.setdefault(name, []).append(child)
    for name, found in children.items():
        if len(found) == 1:
            target.add_module(name, found[0])
        else:
            container = nn.Module()
            _merge(container, found)
            target.add_module(name, container)


class _Stages(nn.Module):
    """The stage modules of one logical model as one module (see the module docstring)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self._stages = tuple(modules)  # a tuple: not registered as submodules
        _merge(self, modules)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        merged: dict[str, Any] = {}
        for module in self._stages:
            for key, value in module.state_dict(*args, **kwargs).items():
                if key in merged:
                    raise ValueError(f"state dict key '{key}' is in two of the modules given")
                merged[key] = value
        return merged

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _Keys:
        missing: list[str] = []
        unexpected = set(state_dict)
        for module in self._stages:
            keys = list(module.state_dict())
            part = {k: state_dict[k] for k in keys if k in state_dict}
            missing += module.load_state_dict(part, strict=strict, assign=assign).missing_keys
            unexpected -= set(keys)
        if strict and unexpected:
            raise RuntimeError(f"state dict keys in none of the modules: {sorted(unexpected)}")
        return _Keys(missing, sorted(unexpected))
