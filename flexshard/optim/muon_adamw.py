"""Muon for hidden matrices, AdamW for the rest, in one optimizer object.

The split follows practice (Keller Jordan's Muon, Moonlight, torchtitan): 2-D hidden
matrices and 3-D expert stacks take Muon; embeddings, the output projection (LM
head), norms and biases take AdamW. Works before and after sharding: a flexshard local
shard is judged by its full shape, not its (possibly flat) local one."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..fsdp.replaced import check_not_replaced
from ..runtime.bucket import slot_of
from .dist_muon import DistMuon
from .newton_schulz import NS_COEFFICIENTS


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded parameter's shape (a flexshard local shard may be flat or empty)."""
    slot = slot_of(param)
    if slot is None:
        return tuple(param.shape)
    bucket, index = slot
    return bucket.layout.params[index].shape


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def output_projection(model: nn.Module) -> nn.Module | None:
    """The LM head: the last ``nn.Linear`` registered in ``model`` (where language models
    put it), or None when the model has no Linear."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def split_named_params(
    model: nn.Module,
    *,
    adamw_patterns: Sequence[str] = (),
    muon_patterns: Sequence[str] = (),
    detect_head: bool = True,
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """:func:`split_muon_params` with the parameters' names (first name of a tied one)."""
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    head = output_projection(model) if detect_head else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    muon, adamw = [], []
    for name, param in model.named_parameters():  # ties appear once, under their first name
        if not param.requires_grad:
            continue
        if _matches(name, muon_patterns):
            muon.append((name, param))
        elif (
            _matches(name, adamw_patterns)
            or id(param) in embedding_ids  # also catches a head tied to the embedding
            or id(param) in head_ids
            or len(full_shape(param)) not in (2, 3)  # norms, biases, scalars
        ):
            adamw.append((name, param))
        else:
            muon.append((name, param))
    return muon, adamw


def split_muon_params(
    model: nn.Module,
    *,
    adamw_patterns: Sequence[str] = (),
    muon_patterns: Sequence[str] = (),
    detect_head: bool = True,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon parameters, AdamW parameters) of ``model``.

    Muon: every 2-D matrix and 3-D expert stack except embeddings (``nn.Embedding``
    weights), the output projection (the last ``nn.Linear``, or any weight tied to an
    embedding) and names matching ``adamw_patterns`` (fnmatch globs). AdamW: those,
    and every parameter that is not 2-D or 3-D (norms, biases). ``muon_patterns``
    force a parameter to Muon; ``detect_head=False`` keeps the last Linear in Muon."""
    muon, adamw = split_named_params(
        model, adamw_patterns=adamw_patterns, muon_patterns=muon_patterns, detect_head=detect_head
    )
    return [p for _, p in muon], [p for _, p in adamw]


class MuonAdamW(DistMuon):
    """One optimizer, two algorithms: groups tagged ``use_muon=True`` step with DistMuon,
    the others with torch's AdamW (its own step function on the same groups and state,
    so bit for bit ``torch.optim.AdamW``). ``state_dict()``, ``load_state_dict()`` and
    ``zero_grad()`` cover both; every state tensor is shaped like its local shard."""

    def __init__(self, param_groups: Iterable[dict[str, Any]], **muon_defaults: Any) -> None:
        # AdamW's own step runs on our AdamW groups and our state: a shell without params
        self._adamw = torch.optim.AdamW([torch.zeros(0, requires_grad=True)])
        self._adamw_defaults = dict(self._adamw.defaults)
        super().__init__(param_groups, **muon_defaults)

    def _is_muon(self, group: dict) -> bool:
        return group.get("use_muon", True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not param_group.get("use_muon", True):
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
            # torch's own checks of the AdamW hyper-parameters (ValueError on bad ones)
            checked = ("lr", "betas", "eps", "weight_decay")
            torch.optim.AdamW([torch.zeros(0)], **{k: param_group[k] for k in checked})
            params = param_group["params"]  # the Muon groups are checked by resolve()
            for param in [params] if isinstance(params, torch.Tensor) else params:
                check_not_replaced(param, "MuonAdamW")
        super().add_param_group(param_group)

    def _muon_step(self) -> None:
        super()._muon_step()
        groups = [g for g in self.param_groups if not self._is_muon(g)]
        if groups:
            self._adamw.param_groups = groups
            self._adamw.state = self.state
            self._adamw.step()


def muon_and_adamw(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.1,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    row_blocks: Mapping[str, int | bool] | None = None,
    adamw_patterns: Sequence[str] = (),
    muon_patterns: Sequence[str] = (),
    detect_head: bool = True,
) -> MuonAdamW:
    """Build one optimizer over ``model``: :func:`split_muon_params`' Muon parameters
    in DistMuon groups, the rest in an AdamW group (``adamw_lr``/``adamw_weight_decay``
    default to ``lr`` and ``weight_decay``). ``row_blocks`` maps FQN globs to rows per
    block (e.g. ``{"*.qkv.weight": head_dim}``; True: each stored BlockShard tile) for
    Muon per attention head. Build it after sharding, as any optimizer over flexshard
    parameters."""
    muon, adamw = split_named_params(
        model, adamw_patterns=adamw_patterns, muon_patterns=muon_patterns, detect_head=detect_head
    )
    row_blocks = dict(row_blocks or {})

    def block_option(name: str) -> int | bool:
        hits = [v for pattern, v in row_blocks.items() if fnmatch.fnmatchcase(name, pattern)]
        return hits[0] if hits else False

    options = [block_option(n) for n, _ in muon]
    groups: list[dict[str, Any]] = []
    for per_block in dict.fromkeys(options):  # distinct, in first-seen order
        members = [m for m, o in zip(muon, options) if o == per_block]
        if members:
            groups.append(
                {
                    "params": [p for _, p in members],
                    "param_names": [n for n, _ in members],
                    "use_muon": True,
                    "row_blocks": per_block,
                }
            )
    if adamw:
        groups.append(
            {
                "params": [p for _, p in adamw],
                "param_names": [n for n, _ in adamw],
                "use_muon": False,
                "lr": lr if adamw_lr is None else adamw_lr,
                "betas": adamw_betas,
                "eps": adamw_eps,
                "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            }
        )
    return MuonAdamW(
        groups,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
