"""Load balancing of the MoE router, one ``LoadBalance`` per MoE layer, chosen by
``model.moe.balance``:

- ``"none"``: plain top-k of the router's softmax (the default; nothing changes).
- ``"bias"``: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias is added
  to the scores for the top-k *selection* only (the weights stay the unbiased scores);
  after every optimizer step ``bias += rate * sign(mean_load - load)``, with the load
  counted over the step's global batch (every micro-batch, every data-parallel and
  context-parallel rank), so every rank keeps the same bias. The bias is training
  state outside the model's parameters and is not in the checkpoints: a resumed run
  starts it again from zero.
- ``"aux"``: the Switch/DeepSeek auxiliary loss ``coef * E * sum_e f_e * P_e`` (f: the
  fraction of this micro-batch's routed rows that chose expert e, P: the mean router
  probability of e). Its gradient is added in the backward of the layer's output
  (Megatron's ``MoEAuxLossAutoScaler``), so the trainer's loss needs no change; it
  acts per micro-batch and rank and is not part of the logged loss.

Every mode counts the tokens routed to each expert in training; ``step_balance``
(called by the trainer after each optimizer step) sums them over the data-parallel
groups, updates the biases and keeps the counts for the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BALANCE_MODES = ("none", "bias", "aux")


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``out``; the backward also hands ``aux`` the gradient 1, as if
    ``aux`` were added to the loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class LoadBalance:
    """One MoE layer's routing choice and load counter (plain state, not parameters)."""

    def __init__(self, mode: str, num_experts: int, bias_rate: float, aux_coef: float) -> None:
        if mode not in BALANCE_MODES:
            raise ValueError(f"model.moe.balance = {mode!r}: must be one of {BALANCE_MODES}")
        self.mode, self.num_experts = mode, num_experts
        self.bias_rate, self.aux_coef = bias_rate, aux_coef
        self.bias: torch.Tensor | None = None  # "bias": fp32 [E], created on first use
        self.load: torch.Tensor | None = None  # tokens per expert since the last step
        self.last_load: list[int] | None = None  # the last step's global counts

    def select(self, scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen experts) [N, top_k] from the router's scores [N, E]."""
        if self.mode != "bias":
            return scores.topk(top_k, dim=-1)
        if self.bias is None:
            self.bias = torch.zeros(self.num_experts, device=scores.device)
        chosen = (scores + self.bias).topk(top_k, dim=-1).indices
        return scores.gather(-1, chosen), chosen

    def account(
        self, out: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """Count the load (training only) and, for ``"aux"``, attach the aux loss to ``out``."""
        if not torch.is_grad_enabled():
            return out
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        self.load = counts if self.load is None else self.load + counts
        if self.mode != "aux":
            return out
        fraction = counts.float() / chosen.numel()
        aux = self.aux_coef * self.num_experts * (fraction * scores.mean(0)).sum()
        return _AddAuxGrad.apply(out, aux)

    def step(self, groups: list[dist.ProcessGroup]) -> None:
        """After an optimizer step: the global load, the bias update, a fresh counter."""
        if self.load is None:
            return
        load = self.load
        for group in groups:  # e.g. dp_replicate, then dp_shard_cp
            dist.all_reduce(load, group=group)
        self.last_load, self.load = load.tolist(), None
        if self.mode == "bias" and self.bias is not None:
            self.bias += self.bias_rate * torch.sign(load.float().mean() - load.float())


def _balances(modules: Iterable[nn.Module]) -> Iterable[tuple[str, LoadBalance]]:
    for root in modules:
        for fqn, module in root.named_modules():
            balance = getattr(module, "balance", None)
            if isinstance(balance, LoadBalance):
                yield fqn, balance


def step_balance(modules: Iterable[nn.Module], groups: list[dist.ProcessGroup]) -> None:
    """Every MoE layer of ``modules``: see ``LoadBalance.step``. Collective over
    ``groups`` (the data-parallel mesh's groups); every rank of them must call it."""
    for _, balance in _balances(modules):
        balance.step(groups)


def tokens_per_expert(modules: Iterable[nn.Module]) -> dict[str, list[int]]:
    """The last step's global tokens per expert, by MoE layer FQN (routed rows: each
    token counts once for each of its top-k experts); {} for a dense model."""
    return {fqn: b.last_load for fqn, b in _balances(modules) if b.last_load is not None}
