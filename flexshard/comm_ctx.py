"""``share_comm_ctx``: torch 2.13's FSDP2 lets several roots (pipeline stages' model
chunks) share one set of CUDA streams, so their buffers do not fragment memory across
streams. flexshard always shares them: every bucket of a process on one CUDA device
uses the same all-gather and reduce-scatter streams (``runtime/device.py``), and CPU
runs have none. The call checks its argument as FSDP2's does and has nothing to do."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's ``share_comm_ctx``; flexshard's roots share their streams already."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
