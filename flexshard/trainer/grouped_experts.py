"""SwiGLU experts over token groups in one call per projection:
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
fp16, fp32 under torch.compile, a hidden size of 20 in bf16) the loop runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def loop_swiglu(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The reference: expert ``e`` on its ``counts[e]`` consecutive rows of ``x``."""
    out = [
        (F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t()
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
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """``loop_swiglu``'s result through three grouped GEMMs on padded groups."""
    if not grouped_mm_runs(x, w1) or not x.shape[0]:  # (no rows: the loop keeps the graph)
        return loop_swiglu(x, counts, w1, w2, w3)
    index, offs, total = _padded_rows(torch.tensor(counts, device=x.device))
    padded = x.new_zeros(total, x.shape[1]).index_copy(0, index, x)
    gate = F.grouped_mm(padded, w1.transpose(-2, -1), offs=offs)
    up = F.grouped_mm(padded, w3.transpose(-2, -1), offs=offs)
    out = F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    return out[index]
