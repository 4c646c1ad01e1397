"""Checkpoints through torch.distributed.checkpoint: each rank writes the regions it stores."""

from .chunks import RegionTensor
from .io import load, save
from .model_state import install_state_dict_hooks
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
