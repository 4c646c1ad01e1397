"""Expert parallelism: the routed experts split across an EP group, tokens sent to the
ranks that own their chosen experts and the results sent back (two uneven
``all_to_all_single``, differentiable; the counts travel first).

EP borrows its ranks from the data-parallel ranks (as torchtitan): each EP rank trains
on its own tokens, keeps ``E / ep`` whole experts of every 3-D ``[E, R, C]`` weight and
computes them for the tokens of the whole EP group. Router and shared experts stay
replicated, so data parallelism syncs them like any other weight; the expert weights
are sharded (by flexshard) over the data-parallel ranks that hold the same experts
(``dp_shard_mod_ep``).

Gradient scale: a data-parallel group of D ranks averages each gradient over D. An
expert weight's gradient already sums the losses of the ``ep`` ranks whose tokens it
served and is then averaged over only D / ep ranks, so it is scaled by ``1 / ep`` on
the way back; with that every weight gets the gradient of the global mean loss.

The integrator calls ``check_ep`` at start-up and ``apply_ep(model, ep_mesh)`` before
data parallelism; the expert weights then need their own flexshard mesh, and the
gradient norm sums them over the EP group too (``fs.clip_grad_norm_(...,
extra_groups=[(expert_params, ep_group)])``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexshard.runtime.bucket import slot_of
from flexshard.runtime.collectives import DEFAULT_TIMEOUT, check_timeout

from ..config import ConfigError
from .context_parallel import Group, as_group
from .exchange import Exchange


def check_ep_ranks(ep: int, dp_shard_cp: int) -> None:
    """EP borrows its ranks from the data- and context-parallel ranks."""
    if dp_shard_cp % ep:
        raise ConfigError(
            f"parallelism.ep = {ep} must divide dp_shard * cp = {dp_shard_cp}: expert "
            "parallelism borrows its ranks from the data-parallel and context-parallel ranks"
        )


def check_ep(num_experts: int, ep: int, dp_shard_cp: int | None) -> None:
    """An EP degree against the MoE and (when known: dp_shard may be inferred from the
    world size later) the data-parallel degree."""
    if ep < 1:
        raise ConfigError(f"parallelism.ep must be >= 1, got {ep}")
    if ep == 1:
        return
    if num_experts == 0:
        raise ConfigError(
            f"parallelism.ep = {ep} needs a mixture-of-experts model (model.moe.num_experts > 0)"
        )
    if num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts = {num_experts} is not divisible by parallelism.ep = {ep}: "
            "every EP rank keeps the same number of whole experts"
        )
    if dp_shard_cp is not None:
        check_ep_ranks(ep, dp_shard_cp)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with uneven splits; the backward sends the gradients home. Both
    are bounded by the exchange's timeout (a CollectiveError naming the layer)."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        exchange: Exchange,
        what: str,
    ) -> torch.Tensor:
        ctx.splits, ctx.exchange, ctx.what = (out_splits, in_splits), exchange, what
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        return exchange.all_to_all(out, rows, f"EP {what} all-to-all", out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        what = f"EP {ctx.what} all-to-all (backward)"
        ctx.exchange.all_to_all(back, grad, what, in_splits, out_splits)
        return back, None, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ExpertParallel:
    """The EP group and this rank's share of the experts of one MoE layer (``name``,
    its FQN, in the errors of its exchanges)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        name: str = "experts",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.group = group
        self.exchange = Exchange(group, name, "ep", timeout)
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = num_experts
        self.local = num_experts // self.size
        self.first = self.rank * self.local

    def routed(
        self, experts: nn.Module, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum for this rank's tokens ``flat`` [N, dim],
        given the router's ``weights`` and ``chosen`` experts [N, top_k]."""
        ep, local, exchange = self.size, self.local, self.exchange
        # one row per (token, choice), sorted by expert (stable: tokens stay in order),
        # hence grouped by the EP rank that owns the expert
        expert_of = chosen.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        token_of = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(
            chosen.shape[1]
        )[order]
        sent = torch.bincount(expert_of, minlength=self.num_experts)
        received = torch.empty_like(sent)  # [source rank, my local expert], flattened
        exchange.all_to_all(received, sent, "EP token-count all-to-all")
        send_splits = sent.view(ep, local).sum(1).tolist()
        recv_counts = received.view(ep, local)
        recv_splits = recv_counts.sum(1).tolist()
        inbound = _AllToAll.apply(flat[token_of], recv_splits, send_splits, exchange, "dispatch")

        # rows arrive by source rank, then by expert: group them by expert to compute
        expert_of_row = torch.arange(local, device=flat.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(recv_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        w1, w2, w3 = (_ScaleGrad.apply(w, 1.0 / ep) for w in (experts.w1, experts.w2, experts.w3))
        computed = experts.swiglu(inbound[by_expert], recv_counts.sum(0).tolist(), (w1, w2, w3))
        outbound = _AllToAll.apply(
            computed[torch.argsort(by_expert)], send_splits, recv_splits, exchange, "combine"
        )

        # combine as the single process does: expert by expert, tokens in order
        routed = outbound * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add(0, token_of, routed)


def apply_ep(
    model: nn.Module, ep_mesh: Group, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> list[str]:
    """Keep this rank's ``E / ep`` experts of every MoE layer (works on a meta-built
    model; ``init_module`` then draws all experts and keeps the slice) and route the
    tokens through the EP group, each exchange waited at most ``timeout``. Returns the
    FQNs of the sliced expert modules, for the data-parallel wrapper to shard on their
    own mesh. Collective-free."""
    check_timeout(timeout)
    group = as_group(ep_mesh)
    ep = dist.get_world_size(group)
    sliced = []
    for fqn, experts in model.named_modules():
        if not hasattr(experts, "expert_parallel"):
            continue
        total = experts.w1.shape[0]
        if experts.ep_range is not None:
            raise ValueError(f"{fqn}: experts already split by apply_ep")
        if any(slot_of(p) is not None for p in experts.parameters()):
            raise ValueError(
                f"{fqn}: the experts are already sharded for data parallelism; apply_ep "
                "comes first (TP -> EP -> CP -> DP)"
            )
        if total % ep:
            raise ValueError(
                f"{fqn}: {total} experts are not divisible by the EP degree {ep}; every EP "
                "rank keeps the same number of whole experts"
            )
        parallel = ExpertParallel(group, total, fqn, timeout)
        keep = slice(parallel.first, parallel.first + parallel.local)
        for name, param in list(experts.named_parameters(recurse=False)):
            piece = nn.Parameter(param.detach()[keep].clone(), requires_grad=param.requires_grad)
            setattr(experts, name, piece)
        experts.ep_range = (parallel.first, total)
        experts.expert_parallel = parallel
        parallel.exchange.attach(experts)  # comm_stats()["ep"] of the sharded model
        sliced.append(fqn)
    if not sliced:
        raise ValueError(f"{type(model).__name__} has no MoE layer to split across EP ranks")
    return sliced


def _split_experts(model: nn.Module) -> Iterator[tuple[str, ExpertParallel]]:
    for fqn, module in model.named_modules():
        parallel = getattr(module, "expert_parallel", None)
        if parallel is not None:
            yield fqn, parallel


def expert_frames(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """FQN -> (the whole ``[E, ...]`` stack's shape, this rank's offset in it) for every
    expert weight ``apply_ep`` split: checkpoints store each slice at its place in the
    stack, one logical model whatever the EP degree."""
    frames = {}
    for fqn, parallel in _split_experts(model):
        for name, param in model.get_submodule(fqn).named_parameters(recurse=False):
            offset = (parallel.first,) + (0,) * (param.dim() - 1)
            frames[f"{fqn}.{name}"] = ((parallel.num_experts, *param.shape[1:]), offset)
    return frames


def whole_experts(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``fs.full_state_dict(model)``'s state with every expert weight ``apply_ep`` split
    all-gathered across its EP group (the ``assemble`` step for EP; unchanged without
    EP). Every EP rank must call it."""
    out = dict(state_dict)
    for fqn, parallel in _split_experts(model):
        for name in ("w1", "w2", "w3"):
            key = f"{fqn}.{name}"
            local = state_dict[key].contiguous()
            whole = local.new_empty(parallel.size * local.numel())
            what = "EP expert-weight all-gather"
            parallel.exchange.all_gather(whole, local.view(-1), what, counted=False)
            out[key] = whole.view(parallel.num_experts, *local.shape[1:])
    return out


def slice_expert_weights(
    model: nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The inverse: a single-process state dict cut to this EP rank's experts, ready
    for ``fs.load_full_state_dict`` (or ``load_state_dict``). No collective."""
    out = dict(state_dict)
    for fqn, parallel in _split_experts(model):
        for name in ("w1", "w2", "w3"):
            key = f"{fqn}.{name}"
            if state_dict[key].shape[0] != parallel.num_experts:
                raise ValueError(
                    f"{key}: {state_dict[key].shape[0]} experts in the state dict, the model "
                    f"has {parallel.num_experts}"
                )
            out[key] = state_dict[key][parallel.first : parallel.first + parallel.local]
    return out
