"""How a job starts on every rank: its process group and device, and where it resumes from."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.comm import default_device
from tessera.launcher.checkpoint import committed_checkpoint
from tessera.launcher.config import RESTART_ENV, Config
from tessera.launcher.run import CHECKPOINT_DIR

__all__ = ["join_ranks", "resume_point"]


def join_ranks() -> torch.device:
    """Join the job's default process group (NCCL with an accelerator, else gloo) unless the
    caller already has; this rank's device (CPU when the caller made the group)."""
    if dist.is_initialized():
        return torch.device("cpu")
    dist.init_process_group("nccl" if torch.accelerator.is_available() else "gloo")
    device = default_device()
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    return device


def resume_point(config: Config, run: Path) -> tuple[str, int]:
    """What the job resumes from and how many times it was restarted: ``train.resume``, or, on an
    elastic restart, the newest committed generation under ``run/checkpoint``."""
    restarts = int(os.environ.get(RESTART_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if restarts and committed_checkpoint(run / CHECKPOINT_DIR) is not None:
        return str(run / CHECKPOINT_DIR), restarts  # an elastic restart goes on from the newest generation
    return config.train.resume, restarts
