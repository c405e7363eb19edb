"""A memory tracer for the warm-up step: peak memory beyond what it started with, per tier.

The host figure is the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` where Linux allows it) minus its resident set at ``start``; the
device figure is the accelerator's peak allocation minus its allocation at ``start``. Where
neither reset exists the tracer reports 0 and says so in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

__all__ = ["MemoryTracer", "rss_bytes"]

log = logging.getLogger(__name__)
_STATUS = Path("/proc/self/status")


def rss_bytes() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in bytes, (0, 0) where /proc is unavailable."""
    try:
        fields = dict(line.split(":", 1) for line in _STATUS.read_text().splitlines() if ":" in line)
    except OSError:
        return 0, 0
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set to the current one; False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class MemoryTracer:
    """Measures the peak memory added between ``start`` and ``stop`` on the host and ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host0: int | None = None
        self._dev0 = 0
        self._can_reset = True

    @property
    def running(self) -> bool:
        """Whether ``start`` was called and ``stop`` not yet."""
        return self._host0 is not None

    def start(self) -> None:
        """Reset the peaks and remember the current usage."""
        self._can_reset = reset_peak_rss()
        if not self._can_reset:
            log.warning(
                "cannot reset the peak RSS here: the host's non-model memory is not measured (taken as 0)"
            )
        self._host0 = rss_bytes()[0]
        if self.device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(self.device)
            self._dev0 = torch.accelerator.memory_allocated(self.device)

    def stop(self) -> tuple[int, int]:
        """``(host, device)`` bytes of peak usage above the usage at ``start``."""
        if self._host0 is None:
            raise RuntimeError("MemoryTracer.stop() without start()")
        host = max(0, rss_bytes()[1] - self._host0) if self._can_reset else 0
        device = 0
        if self.device.type != "cpu":
            device = max(0, torch.accelerator.max_memory_allocated(self.device) - self._dev0)
        self._host0 = None
        return host, device
