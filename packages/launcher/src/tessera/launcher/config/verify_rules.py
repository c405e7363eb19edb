"""What ``train.verify`` cannot be combined with, checked with the configuration before anything
spawns (torch-free; the verifier itself is ``tessera.launcher.train.verify``)."""

from __future__ import annotations

from tessera.launcher.config.boost_config import BoostConfig
from tessera.launcher.config.main_config import Config

__all__ = ["verify_problems"]


def verify_problems(config: BoostConfig, *, main_job: bool) -> list[str]:
    """Why ``train.verify`` cannot compare a step of ``config``'s job with a serial one, one line
    each (``tessera.launcher.train.verify`` also refuses a model with dropout; ``main_job``: the main
    job's model dropout is ``model.dropout``)."""
    errors = []
    if config.zero.chunked:
        errors.append(
            "train.verify with the chunk memory manager (zero.*budget_mb, zero.disk_dir): it steps "
            "chunk by chunk; verify without it"
        )
    if main_job and isinstance(config, Config) and config.model.dropout > 0:
        errors.append(
            f"train.verify with model.dropout={config.model.dropout}: the random streams differ between "
            "the serial and the parallel model; verify with model.dropout=0"
        )
    return errors
