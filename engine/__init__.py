"""ShardScope's analytic engine: the Config schema and the models that predict from it.

Pure Python + numpy: never imports torch or Qt, so it answers in milliseconds.
"""

from engine.config import (
    ClusterSpec,
    Config,
    ConfigError,
    Conventions,
    GPUSpec,
    ModelSpec,
    ParallelSpec,
    Problem,
    TrainingSpec,
    default_config,
)
from engine.names import MEMORY_CATEGORIES, SCHEDULES

__all__ = [
    "ClusterSpec",
    "Config",
    "ConfigError",
    "Conventions",
    "GPUSpec",
    "MEMORY_CATEGORIES",
    "ModelSpec",
    "ParallelSpec",
    "Problem",
    "SCHEDULES",
    "TrainingSpec",
    "default_config",
]
