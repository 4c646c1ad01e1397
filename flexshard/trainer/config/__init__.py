"""The trainer's TOML config: the dataclasses per section (``schema``), the loader with
command-line overrides (``loader``), what it reads to fill the model (a Hugging Face
``config.json``: ``hf_config``; the tokenizer's ids: ``tokenizer``) and the checks of
the config's own values (``validation``). The bottom layer of the trainer: the checks
that need a parallelism or a component live beside it."""

from .loader import config_from_dict, load_config, parse_overrides
from .schema import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    Config,
    ConfigError,
    DataConfig,
    DeepseekV4Config,
    JobConfig,
    LinearAttentionConfig,
    ModelConfig,
    MoEConfig,
    ParallelismConfig,
    RLConfig,
    RopeScalingConfig,
    TrainingConfig,
    ValidationConfig,
)

__all__ = [
    "ConfigError",
    "MoEConfig",
    "LinearAttentionConfig",
    "DeepseekV4Config",
    "ModelConfig",
    "RopeScalingConfig",
    "ParallelismConfig",
    "RLConfig",
    "TrainingConfig",
    "DataConfig",
    "JobConfig",
    "CheckpointConfig",
    "ValidationConfig",
    "CompileConfig",
    "ActivationCheckpointConfig",
    "Config",
    "config_from_dict",
    "load_config",
    "parse_overrides",
]
