"""tessera.launcher: `tessera run` over torchrun, one typed config, boost() and the training engine.

Inside a script started by ``tessera run``, ``load_config()`` returns the configuration the
launcher resolved and validated; ``boost(model, optimizer, config)`` composes TP, PP and
ZeRO / DP into an `Engine` that trains, evaluates, saves, loads and consolidates.

``boost``, ``Engine``, ``StepOutput``, ``Diverged``, the model contract (``ModelSpec``,
``model_spec``, ``register_model_spec``) and deferred initialization
(``deferred_parameters``, ``init_by_name``) are imported on first use (PEP 562),
so that the launcher validates a configuration without importing torch.
"""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports
from tessera.launcher.config import (
    BoostConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
)
from tessera.launcher.config.config_io import ConfigError, load_config, resolve_config

if TYPE_CHECKING:
    from tessera.launcher.families.spec import (
        ModelSpec,
        model_spec,
        register_model_family,
        register_model_spec,
    )
    from tessera.launcher.train.boost import boost
    from tessera.launcher.train.deferred import deferred_parameters, init_by_name
    from tessera.launcher.train.engine import Diverged, Engine, StepOutput

__version__ = "0.1.0"

__all__ = [
    "BoostConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "Diverged",
    "Engine",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "ModelSpec",
    "OptimConfig",
    "ParallelConfig",
    "StepOutput",
    "TrainConfig",
    "ZeroConfig",
    "boost",
    "deferred_parameters",
    "init_by_name",
    "load_config",
    "model_spec",
    "register_model_family",
    "register_model_spec",
    "resolve_config",
]

if not TYPE_CHECKING:  # hidden from mypy, which then checks every name as imported above
    _LAZY = ("train.boost", "train.deferred", "train.engine", "families.spec")
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
