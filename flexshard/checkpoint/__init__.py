"""Checkpoints through torch.distributed.checkpoint: torch's DCP state-dict API for the
state, each rank writing the chunks it stores; saved atomically with a manifest,
checked before loading; the whole model as a Hugging Face folder's safetensors files
(``export_safetensors``, names from ``HFKey``s)."""

from ..fsdp.state_dict import install_state_dict_hooks
from ..runtime.dtensor.chunks import RegionTensor
from .hf_safetensors import HFKey, export_safetensors
from .io import load, load_state, save, save_state
from .state import load_optimizer_state_dict, optimizer_state_dict

__all__ = [
    "HFKey",
    "RegionTensor",
    "export_safetensors",
    "install_state_dict_hooks",
    "load",
    "load_optimizer_state_dict",
    "load_state",
    "optimizer_state_dict",
    "save",
    "save_state",
]
