"""The main job's side of a stop on SIGINT, SIGTERM or SIGUSR1 (``tessera.launcher.run.stopping``).

`StopRequest` turns any of them into a request that the training loop reads at each step
boundary through one small all-reduce, so every rank stops after the same step; the job then
saves a generation there and `StopRequest.announce` logs where and leaves the launcher its note.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from tessera.launcher.run import STOP_SIGNALS, StopNote, leave_note

__all__ = ["StopRequest"]

log = logging.getLogger("tessera.train")


class StopRequest:
    """SIGINT, SIGTERM and SIGUSR1 (`STOP_SIGNALS`) noted (the first one) instead of ending the
    process, while the context is open (in the main thread; elsewhere signals are left as they are)."""

    def __init__(self) -> None:
        self.signum = 0
        self._before: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._before = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum  # the agent's copy of a Ctrl-C changes nothing

    def agreed(self, device: torch.device) -> int:
        """The signal any rank has received (0: none): collective over every rank, so all of
        them stop after the same step."""
        if dist.get_world_size() == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    @staticmethod
    def announce(signum: int, step: int, generation: Path, checkpoint: Path) -> None:
        """Log (rank 0) where the stop saved, and leave the launcher the note it reports."""
        note = StopNote(signal.Signals(signum).name, step, str(generation), str(checkpoint))
        log.info(
            "stopped by %s after step %d: saved %s; resume with --set train.resume=%s",
            note.signal,
            step,
            generation,
            checkpoint,
        )
        leave_note(note)
