"""Training: ``boost()`` (TP and context parallelism, then PP, then ZeRO / DP, as named steps),
the `Engine` it returns, each way of splitting a batch and its loss (``objective``), the first-step
check against serial (``verify``, ``twin``), deferred initialization, activation recompute,
per-block compile, and expert parallelism (``experts``, ``moe_style``)."""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports

if TYPE_CHECKING:
    from tessera.launcher.train.boost import boost
    from tessera.launcher.train.engine import Engine
    from tessera.launcher.train.moe_style import MOE_STYLE

__all__ = ["MOE_STYLE", "Engine", "boost"]

if not TYPE_CHECKING:  # imported on first use (PEP 562), so the package stays light to import
    __getattr__, __dir__ = lazy_exports(__name__, ("boost", "engine", "moe_style"))
