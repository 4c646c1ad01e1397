"""An LLM trainer on flexshard: Llama-style model (dense or MoE), byte-level data,
TOML config, data parallelism through flexshard or torch FSDP2, metrics, checkpoints.

    flexshard-train --nproc 3 --config configs/debug.toml --training.steps 20
"""

from .config import Config, ConfigError, load_config
from .models.model import Transformer
from .train import run

__all__ = ["Config", "ConfigError", "Transformer", "load_config", "run"]
