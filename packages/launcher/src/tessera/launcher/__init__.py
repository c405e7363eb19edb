"""tessera.launcher: `tessera run` over torchrun, one typed config, boost() and the training engine.

Inside a script started by ``tessera run``, ``load_config()`` returns the configuration the
launcher resolved and validated; ``boost(model, optimizer, config)`` composes TP, PP and
ZeRO / DP into an `Engine` that trains, evaluates, saves, loads and consolidates.
"""

from tessera.launcher.boost import boost
from tessera.launcher.config import (
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
)
from tessera.launcher.config_io import ConfigError, load_config, resolve_config
from tessera.launcher.engine import Diverged, Engine, StepOutput

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "Diverged",
    "Engine",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "StepOutput",
    "TrainConfig",
    "ZeroConfig",
    "boost",
    "load_config",
    "resolve_config",
]
