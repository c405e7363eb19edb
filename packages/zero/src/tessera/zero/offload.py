"""ZeRO-Offload's host side: buffers in host memory, copies to and from the device.

Master weights, gradients for the optimizer and optimizer state live on the host, and the
optimizer steps there. Host buffers are pinned only when an accelerator exists (pinning
without one is an error on some builds and pointless on all), so copies from the device are
asynchronous there and plain copies on a CPU-only machine, where the same code runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HOST", "host_empty", "host_zeros", "sync_device", "to_device_", "to_host_"]

HOST = torch.device("cpu")


def _pin() -> bool:
    return torch.accelerator.is_available()


def host_empty(numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised 1-D host tensor, pinned where an accelerator exists."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=_pin())


def host_zeros(numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A zeroed 1-D host tensor, pinned where an accelerator exists."""
    return host_empty(numel, dtype).zero_()


def to_host_(dst: Tensor, src: Tensor, *, accumulate: bool) -> None:
    """Copy (or add) device tensor ``src`` into host tensor ``dst``, converting the dtype.

    A copy is asynchronous from an accelerator (call ``sync_device`` before reading ``dst``);
    an add needs the values on the host, so it waits for its own copy.
    """
    with torch.no_grad():
        if accumulate:
            dst.add_(src.to(HOST, dtype=dst.dtype))
        else:
            dst.copy_(src, non_blocking=src.device.type != "cpu")


def to_device_(dst: Tensor, src: Tensor) -> None:
    """Copy host tensor ``src`` into device tensor ``dst`` (asynchronously from pinned memory)."""
    with torch.no_grad():
        dst.copy_(src, non_blocking=dst.device.type != "cpu")


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (copies to the host included); a no-op on the CPU."""
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)
