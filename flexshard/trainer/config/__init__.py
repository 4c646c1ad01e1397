"""The trainer's TOML config: the dataclasses per section (``schema``), the loader with
command-line overrides (``loader``) and every start-up check (``validation``)."""

from .loader import config_from_dict, load_config, parse_overrides
from .schema import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    Config,
    ConfigError,
    DataConfig,
    JobConfig,
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
