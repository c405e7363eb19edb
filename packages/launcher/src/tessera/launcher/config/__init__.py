"""One typed configuration for a Tessera job, and its validation.

`BoostConfig` (``boost_config``) holds what ``boost()`` and the engine read (``[parallel]``,
``[zero]``, ``[optim]``, ``[train]``, ``[logging]``); `Config` (``main_config``), the one
``tessera`` resolves, adds the main job's ``[model]`` and ``[data]``. ``validate()`` returns
every mistake as one line naming the field and the numbers (or the allowed names of a choice:
``tessera.launcher.config.choices``), so a launcher can refuse a job before anything spawns.
Loading (TOML file, then environment, then command-line flags) lives in ``config_io``.
"""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports
from tessera.launcher.config.boost_config import (
    BoostConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
)
from tessera.launcher.config.main_config import Config, DataConfig, ModelConfig, MoEConfig

if TYPE_CHECKING:
    from tessera.launcher.config.config_io import RESTART_ENV, config_to_toml

__all__ = [
    "RESTART_ENV",
    "BoostConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "ZeroConfig",
    "config_to_toml",
]

if not TYPE_CHECKING:  # config_io imports this package: its names are imported on first use (PEP 562)
    __getattr__, __dir__ = lazy_exports(__name__, ("config_io",))
