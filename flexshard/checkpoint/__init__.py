"""Checkpoints through torch.distributed.checkpoint: each rank writes the regions it stores."""

from ..runtime.dcp_chunks import RegionTensor
from ..state_dict_hooks import install_state_dict_hooks
from .io import load, save
from .optimizer_state import load_optimizer_state_dict, optimizer_state_dict
from .safetensors_export import export_safetensors

__all__ = [
    "RegionTensor",
    "export_safetensors",
    "install_state_dict_hooks",
    "load",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "save",
]
