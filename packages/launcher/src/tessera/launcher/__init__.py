"""tessera.launcher: `tessera run` over torchrun, one typed config, boost() and the training engine.

Inside a script started by ``tessera run``, ``load_config()`` returns the configuration the
launcher resolved and validated.
"""

from tessera.launcher.config import Config
from tessera.launcher.config_io import ConfigError, load_config, resolve_config

__all__ = ["Config", "ConfigError", "load_config", "resolve_config"]
