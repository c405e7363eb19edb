"""Rank-aware logging: Tessera's library code logs through ``logging``; this decides who is heard.

``configure_logging()`` installs one handler on the ``tessera`` logger that prefixes each line
with the rank and, by default, lets only rank 0 through (every rank still logs warnings and
errors). Nothing is configured on import: an application that sets up logging itself keeps
full control.
"""

from __future__ import annotations

import logging
import os

__all__ = ["RankFilter", "configure_logging", "current_rank"]


def current_rank() -> int:
    """This process's global rank: torch.distributed's if initialised, else $RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankFilter(logging.Filter):
    """Adds ``record.rank``; passes records of rank 0, or of any rank at ``min_level`` and above."""

    def __init__(self, *, all_ranks: bool = False, min_level: int = logging.WARNING) -> None:
        super().__init__()
        self.all_ranks = all_ranks
        self.min_level = min_level

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        return self.all_ranks or rank == 0 or record.levelno >= self.min_level


def configure_logging(level: int = logging.INFO, *, all_ranks: bool = False) -> logging.Handler:
    """Send the ``tessera`` loggers to stderr as ``[rank N] LEVEL name: message``."""
    handler = logging.StreamHandler()
    handler.addFilter(RankFilter(all_ranks=all_ranks))
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("tessera")
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
