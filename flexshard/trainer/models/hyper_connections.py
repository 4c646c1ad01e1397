"""DeepSeek-V4's manifold-constrained hyper-connections: the residual is ``hc_mult``
streams [b, s, n, d]; before a block they collapse to one input (``pre`` weights), after
it the block's output is spread back over them (``post``) and added to the streams mixed
by ``comb``, a doubly stochastic n x n matrix (Sinkhorn-Knopp on a softmax). All three
come per token from one projection (``fn``) of the RMS-normalised streams, plus a
learned offset (``base``) and one scale per kind (``scale``). Computed in fp32, as
transformers' reference keeps these modules.

Every weight here acts per token: under sequence-parallel tp (``tp_mesh``, set by
``apply_tp``) each tp rank mixes its own tokens' streams with the replicated ``fn``,
``base`` and ``scale``, whose gradients are then summed over tp; without sequence
parallelism every tp rank computes the same, and their gradients are already whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .mla import _all_reduce_grad


def summed_over(mesh: DeviceMesh | None, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``params`` as they are, their gradients summed over ``mesh`` (when given) in one
    all-reduce: they are small, and each would otherwise cost one of its own."""
    if mesh is None:
        return params
    flat = _all_reduce_grad(torch.cat([p.reshape(-1) for p in params]), mesh)
    return tuple(
        part.view_as(p) for part, p in zip(flat.split([p.numel() for p in params]), params)
    )


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One block side's (attention or feed-forward) mixing weights; the parameters sit
    on the block (``hc_attn_fn`` ...), as DeepSeek's checkpoints name them."""

    def __init__(self, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.streams, self.sinkhorn_iters = streams, sinkhorn_iters
        self.eps, self.norm_eps = eps, norm_eps
        self.tp_mesh: DeviceMesh | None = None  # set by apply_tp (see the module's docstring)

    def weights(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [b, s, n], comb [b, s, n, n], the collapsed block input [b, s, d])."""
        n = self.streams
        b, s = streams.shape[:2]
        fn, base, scale = summed_over(self.tp_mesh, fn, base, scale)
        flat = unweighted_rms_norm(streams.reshape(b, s, -1).float(), self.norm_eps)
        mixes = F.linear(flat, fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):  # rows, then columns, summing to one
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a block of output ``out`` [b, s, d]."""
        dtype = streams.dtype
        spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
        return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The streams collapsed into one hidden state before the final norm."""

    def __init__(self, dim: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * dim))
        self.hc_base = nn.Parameter(torch.empty(streams))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.init_stds = {"hc_fn": 0.02, "hc_base": "zeros", "hc_scale": None}
        self.tp_mesh: DeviceMesh | None = None  # set by apply_tp (see the module's docstring)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        fn, base, scale = summed_over(self.tp_mesh, self.hc_fn, self.hc_base, self.hc_scale)
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, fn.float())
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
