"""Structured, validated configuration.

A run's config is a recipe YAML plus CLI dotlist overrides (`trainer.total_steps=3`), merged by
omegaconf and then converted into the dataclasses of sections.py. Unknown keys, wrong types and
impossible values fail at load time with one message naming the key, the value given, and
what is allowed. Each component receives its own section, never the root.

    sections.py   one dataclass per component section, each validating its own keys
    root.py       RayflowConfig: the sections together, and the rules that span them
    loading.py    YAML + overrides -> RayflowConfig (and back)
"""

from rayflow.config.loading import (
    default_run_name, from_dict, load_config, set_dotted, split_overrides, to_dict, to_yaml, unread_at_defaults,
)
from rayflow.config.root import RayflowConfig, yaml_key
from rayflow.config.sections import (
    AlgorithmConfig, AsyncConfig, CFGConfig, DataConfig, LearnerConfig, LoggingConfig, ModelConfig, PlacementConfig,
    RewardConfig, RewardFnConfig, RolloutConfig, SyncConfig, TrainerConfig,
)

__all__ = [
    "AlgorithmConfig", "AsyncConfig", "CFGConfig", "DataConfig", "LearnerConfig", "LoggingConfig", "ModelConfig",
    "PlacementConfig", "RayflowConfig", "RewardConfig", "RewardFnConfig", "RolloutConfig", "SyncConfig",
    "TrainerConfig", "default_run_name", "from_dict", "load_config", "set_dotted", "split_overrides", "to_dict",
    "to_yaml", "unread_at_defaults", "yaml_key",
]
