"""Typed config: dataclass tree (schema), TOML loading with inheritance and overrides, validation."""
from .docs import config_reference, field_docs, to_toml
from .loader import load_config
from .schema import (
    ActorConfig,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    CriticConfig,
    DataConfig,
    DistillConfig,
    HooksConfig,
    LoggingConfig,
    LoRAConfig,
    MemoryConfig,
    ModelConfig,
    PlacementConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from .validate import validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "CheckpointConfig", "Config", "CriticConfig", "DataConfig", "DistillConfig", "HooksConfig",
    "LoggingConfig", "LoRAConfig", "MemoryConfig", "ModelConfig", "PlacementConfig", "RefConfig", "RewardConfig", "RolloutConfig",
    "TrainerConfig", "config_reference", "field_docs", "load_config", "to_toml", "validate",
]
