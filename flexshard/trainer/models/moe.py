"""Load balancing of the MoE router, one ``LoadBalance`` per MoE layer, chosen by
``model.moe.balance``:

- ``"none"``: plain top-k of the router's softmax (the default; nothing changes).
- ``"bias"``: DeepSeek-V3's auxiliary-loss-free balancing. A per-expert bias is added
  to the scores for the top-k *selection* only (the weights stay the unbiased scores);
  after every optimizer step ``bias += rate * sign(mean_load - load)``, with the load
  counted over the step's global batch (every micro-batch, every data-parallel and
  context-parallel rank), so every rank keeps the same bias. The bias is a persistent
  buffer of the layer (``layers.<i>.feed_forward.balance.bias``, fp32 ``[E]``, equal on
  every rank, never sliced by EP): it is in the model's state dict, hence in every
  checkpoint (DCP, both trainer backends, pipeline stages under their global FQNs) and
  in the safetensors export, since it changes which experts a token reaches; a resumed
  run continues with the saved bias. The other modes hold no buffer (their state dicts
  are unchanged).
- ``"aux"``: the Switch/DeepSeek auxiliary loss ``coef * E * sum_e f_e * P_e`` (f: the
  fraction of this micro-batch's routed rows that chose expert e, P: the mean router
  probability of e). Its gradient is added in the backward of the layer's output
  (Megatron's ``MoEAuxLossAutoScaler``), so the trainer's loss needs no change; it
  acts per micro-batch and rank and is not part of the logged loss.

Every mode counts the tokens routed to each expert in training; ``step_balance``
(called by the trainer after each optimizer step) sums them over the data-parallel
ranks with the all-reduce the trainer passes in (the model imports no parallelism),
updates the biases and keeps the counts for the metrics; ``tokens_per_expert``
gathers them over the pipeline stages, so the metrics cover every MoE layer.

SwiGLU experts over token groups in one call per projection:
``torch.nn.functional.grouped_mm`` on the rows sorted by expert, instead of a Python
loop of three matmuls per expert (kept as ``loop_swiglu``, the reference in tests).

grouped_mm takes the rows as one 2-D tensor cut by ``offs`` (int32 ends of the
groups) and the weights as ``[E, K, N]``; ``w.transpose(-2, -1)`` of our nn.Linear-
style ``[E, R, C]`` weights is the column-major operand it wants. The CUDA kernels
(bf16, sm80+) want every group to start on an aligned row, so the groups are padded
with zero rows to a multiple of ``GROUP_ALIGN`` (16 rows: bf16's 8 and fp8's 16) and
the padding dropped after; the CPU kernel (fp32 and bf16, torch 2.13) needs no
padding but gets the same layout, so one code path is tested. Both want row strides
of 16 bytes; where the dtype or the dims do not fit (``grouped_mm_runs``: CUDA fp32,
fp16, fp32 under torch.compile, a hidden size of 20 in bf16) the loop runs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: sums a tensor in place over the data-parallel ranks; its str names what is summed
#: (the MoE layer) in the error of a collective that fails
SumOverRanks = Callable[[torch.Tensor, str], object]

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


class LoadBalance(nn.Module):
    """One MoE layer's routing choice and load counter: no parameters; in mode
    ``"bias"`` the bias is a persistent buffer (model state, fp32 whatever the module
    is cast to), the counts are not."""

    bias: torch.Tensor | None

    def __init__(self, mode: str, num_experts: int, bias_rate: float, aux_coef: float) -> None:
        if mode not in BALANCE_MODES:
            raise ValueError(f"model.moe.balance = {mode!r}: must be one of {BALANCE_MODES}")
        super().__init__()
        self.mode, self.num_experts = mode, num_experts
        self.bias_rate, self.aux_coef = bias_rate, aux_coef
        # "bias": fp32 [E] (on the device the model is built on); None: not in the state
        self.register_buffer("bias", torch.zeros(num_experts) if mode == "bias" else None)
        self.load: torch.Tensor | None = None  # tokens per expert since the last step
        self.last_load: list[int] | None = None  # the last step's global counts

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # a meta-built model's ``to_empty`` leaves the buffer uninitialised, and
        # ``fs.init_params`` visits modules with parameters only: start from zero, as an
        # eagerly built model does (a checkpoint loaded afterwards overwrites it)
        was_meta = self.bias is not None and self.bias.is_meta
        super()._apply(fn, recurse)
        if self.bias is None:
            return self
        if self.bias.dtype != torch.float32:  # model.to(bf16): updates of 1e-3 would vanish
            self.bias = self.bias.float()
        if was_meta and not self.bias.is_meta:
            with torch.no_grad():
                self.bias.zero_()
        return self

    def select(
        self, scores: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen experts) [N, top_k] from the router's scores [N, E]; with
        ``n_group > 1`` only from each token's ``topk_group`` best expert groups."""
        if self.bias is None and n_group == 1:
            return scores.topk(top_k, dim=-1)
        biased = scores if self.bias is None else scores + self.bias
        if n_group > 1:
            biased = group_limited(biased, n_group, topk_group)
        chosen = biased.topk(top_k, dim=-1).indices
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

    def step(self, sum_over_ranks: SumOverRanks | None = None, layer: str = "") -> None:
        """After an optimizer step: the global load, the bias update, a fresh counter.
        ``sum_over_ranks`` None: this process holds the whole batch."""
        if self.load is None:
            return
        load = self.load
        if sum_over_ranks is not None:
            sum_over_ranks(load, f"layer '{layer}'")
        self.last_load, self.load = load.tolist(), None
        if self.bias is not None:
            with torch.no_grad():
                self.bias += self.bias_rate * torch.sign(load.float().mean() - load.float())


def group_limited(scores: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: ``scores`` [N, E] with every expert outside
    each token's ``topk_group`` best groups (of ``n_group`` equal ones, a group scored by
    the sum of its two best scores) set to -inf."""
    grouped = scores.view(scores.shape[0], n_group, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)


def _balances(modules: Iterable[nn.Module]) -> Iterable[tuple[str, LoadBalance]]:
    for root in modules:
        for fqn, module in root.named_modules():
            balance = getattr(module, "balance", None)
            if isinstance(balance, LoadBalance):
                yield fqn, balance


def step_balance(modules: Iterable[nn.Module], sum_over_ranks: SumOverRanks | None = None) -> None:
    """Every MoE layer of ``modules``: see ``LoadBalance.step``. ``sum_over_ranks`` is
    collective (the trainer's bounded all-reduce over the data-parallel mesh's groups):
    every rank of them must call this."""
    for fqn, balance in _balances(modules):
        balance.step(sum_over_ranks, fqn)


def tokens_per_expert(
    modules: Iterable[nn.Module], pp_group: dist.ProcessGroup | None = None
) -> dict[str, list[int]]:
    """The last step's global tokens per expert, by MoE layer FQN (routed rows: each
    token counts once for each of its top-k experts), in layer order; {} for a dense
    model. ``pp_group``: this rank holds some pipeline stages only; the counts of every
    stage are gathered (a collective: every rank of the group calls it), so each rank
    gets every MoE layer's. Stage modules keep the whole model's FQNs, so the layers of
    different stages never share a key."""
    mine = {fqn: b.last_load for fqn, b in _balances(modules) if b.last_load is not None}
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return mine
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    merged: dict[str, list[int]] = {}
    for stage in stages:
        for fqn, counts in stage.items():
            if merged.setdefault(fqn, counts) != counts:
                raise ValueError(
                    f"tokens_per_expert: MoE layer '{fqn}' is on two pipeline ranks with "
                    "different counts; the pp group must hold each layer once"
                )
    return {fqn: merged[fqn] for fqn in sorted(merged, key=_layer_order)}


def _layer_order(fqn: str) -> list[tuple[int, int, str]]:
    """ "layers.10.x" after "layers.9.x": numeric parts compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in fqn.split(".")]


GROUP_ALIGN = 16


def grouped_mm_runs(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes rows ``x`` [n, dim] and weights ``w1`` [E, hidden,
    dim]: its kernels want bf16 (CUDA) or fp32/bf16 (CPU) and every row stride a multiple
    of 16 bytes (dim and hidden of 8 bf16 or 4 fp32 values); else the loop runs. Under
    torch.compile bf16 only: the op's meta function (torch 2.13) rejects fp32."""
    allowed: tuple[torch.dtype, ...] = ()
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        allowed = (torch.float32, torch.bfloat16)
    elif x.device.type in ("cpu", "cuda"):
        allowed = (torch.bfloat16,)
    return x.dtype in allowed and all(n * x.element_size() % 16 == 0 for n in w1.shape[1:])


def gated(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``; with a ``limit`` (DeepSeek-V4's clamp) the gate
    clamped above and ``up`` on both sides at it."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def loop_swiglu(
    x: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """The reference: expert ``e`` on its ``counts[e]`` consecutive rows of ``x``."""
    out = [
        gated(rows @ w1[e].t(), rows @ w3[e].t(), limit) @ w2[e].t()
        for e, rows in enumerate(x.split(counts))
    ]
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


def _padded_rows(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes once every group is padded to ``GROUP_ALIGN`` rows: the row
    indices into the padded tensor, the groups' int32 ends there and its length."""
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    group_of_row = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    start_in = counts.cumsum(0) - counts  # each group's first row, unpadded and padded
    start_out = ends - padded
    rows = torch.arange(int(counts.sum()), device=counts.device)
    index = rows - start_in[group_of_row] + start_out[group_of_row]
    return index, ends.to(torch.int32), int(ends[-1]) if len(counts) else 0


def grouped_swiglu(
    x: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """``loop_swiglu``'s result through three grouped GEMMs on padded groups."""
    if not grouped_mm_runs(x, w1) or not x.shape[0]:  # (no rows: the loop keeps the graph)
        return loop_swiglu(x, counts, w1, w2, w3, limit)
    index, offs, total = _padded_rows(torch.tensor(counts, device=x.device))
    padded = x.new_zeros(total, x.shape[1]).index_copy(0, index, x)
    gate = F.grouped_mm(padded, w1.transpose(-2, -1), offs=offs)
    up = F.grouped_mm(padded, w3.transpose(-2, -1), offs=offs)
    out = F.grouped_mm(gated(gate, up, limit), w2.transpose(-2, -1), offs=offs)
    return out[index]


def routed_locally(
    experts: nn.Module, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """Per token of ``flat`` [N, dim], the ``weights``-weighted sum of its ``chosen``
    experts' outputs [N, top_k], every expert of ``experts`` (``w1`` [E, ...] and
    ``swiglu(rows, counts, (w1, w2, w3))``) on this rank: one row per (token, choice),
    sorted by expert (stable: tokens stay in order), each token's rows added expert by
    expert, in the order of a loop over the experts."""
    order = torch.argsort(chosen.reshape(-1), stable=True)
    token_of = order // chosen.shape[1]
    counts = torch.bincount(chosen.reshape(-1), minlength=experts.w1.shape[0]).tolist()
    computed = experts.swiglu(flat[token_of], counts, (experts.w1, experts.w2, experts.w3))
    routed = computed * weights.reshape(-1)[order, None]
    return torch.zeros_like(flat).index_add(0, token_of, routed)
