"""Placement: which tier each chunk lives on, under the budgets (pure functions of integers).

Chunks are placed in the order they are used (recorded during the warm-up step; chunk order
before it), fastest tier first: the device up to its capacity, then the host, then the disk.
``static`` with ``fractions`` caps each tier at its share of the chunk bytes as well.
A tier's capacity is its budget minus what it must keep free: the host keeps room for the
staging buffers that disk chunks pass through (the one in use and the one being
prefetched), every tier one chunk's worth of scratch for the optimizer's temporaries, and
under ``auto`` the non-model memory measured in the warm-up. Everything that cannot be
placed is a ``ValueError`` naming the numbers, raised before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessera.zero.chunks.chunk import Tier

__all__ = ["Capacities", "capacities", "place"]

_MIB = 2**20


def _mib(n: int | float) -> str:
    return f"{n / _MIB:.4g} MiB"


@dataclass(frozen=True, slots=True)
class Capacities:
    """Bytes of chunks each tier may hold (``None``: unlimited)."""

    device: int
    host: int | None
    disk: int | None


def capacities(
    *,
    device_budget: int | None,
    host_budget: int | None,
    disk: bool,
    staging: int,
    scratch: int = 0,
    reserve_device: int = 0,
    reserve_host: int = 0,
) -> Capacities:
    """The chunk bytes each tier may hold: the budget minus the staging buffers (host, when a
    disk tier exists), the optimizer's scratch (one chunk's worth on every tier chunks step
    on: Adam's temporaries) and the reserved non-model memory; a budget that cannot hold even
    that working set is a ValueError."""
    host_needs = (staging if disk else 0) + scratch + reserve_host
    if host_budget is not None and host_budget < host_needs:
        parts = [f"{_mib(staging)} of staging for disk chunks in flight"] if disk else []
        parts += [f"{_mib(scratch)} of optimizer scratch"] if scratch else []
        parts += [f"{_mib(reserve_host)} of measured non-model memory"] if reserve_host else []
        raise ValueError(
            f"host_budget_mb={host_budget / _MIB:.4g} cannot hold the working set: {' + '.join(parts)} = "
            f"{_mib(host_needs)} (raise the budget or lower chunk_numel)"
        )
    device = 0 if device_budget is None else device_budget - reserve_device - scratch
    if device_budget is not None and device < 0:
        raise ValueError(
            f"device_budget_mb={device_budget / _MIB:.4g} cannot hold the working set: "
            f"{_mib(scratch)} of optimizer scratch + {_mib(reserve_device)} of measured non-model memory"
        )
    host = None if host_budget is None else host_budget - host_needs
    return Capacities(device=device, host=host, disk=None if disk else 0)


def place(
    chunk_bytes: Sequence[int],
    caps: Capacities,
    *,
    fractions: tuple[float, float, float] | None = None,
    slowest_first: bool = False,
) -> list[Tier]:
    """The tier of each chunk (``chunk_bytes`` in use order): fastest tier first up to its
    capacity (and its share under ``fractions``), or the slowest available first when
    ``slowest_first`` (auto's placement before the warm-up measured anything)."""
    total = sum(chunk_bytes)
    limits: dict[Tier, float] = {
        Tier.DEVICE: caps.device,
        Tier.HOST: float("inf") if caps.host is None else caps.host,
        Tier.DISK: float("inf") if caps.disk is None else caps.disk,
    }
    if fractions is not None:
        for tier, share in zip((Tier.DEVICE, Tier.HOST, Tier.DISK), fractions, strict=True):
            if share > 0 and limits[tier] == 0:
                raise ValueError(
                    f"fractions give the {tier.value} tier {share:g} of the chunks but it has no budget"
                )
            limits[tier] = min(limits[tier], share * total + 0.5)
    room = sum(limits.values())
    if total > room:
        raise ValueError(
            f"the model data needs {_mib(total)} in chunks but the tiers hold {_mib(room)} "
            f"(device {_mib(limits[Tier.DEVICE])}, host {_mib(limits[Tier.HOST])}, "
            f"disk {'none' if limits[Tier.DISK] == 0 else _mib(limits[Tier.DISK])}); "
            "raise a budget or give disk_dir"
        )
    order = [Tier.DEVICE, Tier.HOST, Tier.DISK]
    if slowest_first:
        order.reverse()
    used = dict.fromkeys(order, 0)
    out = []
    for n in chunk_bytes:
        for tier in order:
            if used[tier] + n <= limits[tier]:
                used[tier] += n
                out.append(tier)
                break
        else:  # shares rounded it out of every tier, or it fits no gap: any tier with real room
            real = {Tier.DEVICE: caps.device, Tier.HOST: caps.host, Tier.DISK: caps.disk}
            spare = next((t for t in reversed(order) if (c := real[t]) is None or used[t] + n <= c), None)
            if spare is None:
                raise ValueError(
                    f"a chunk of {_mib(n)} fits on no tier (device {_mib(used[Tier.DEVICE])} used of "
                    f"{_mib(caps.device)}, host {_mib(used[Tier.HOST])} of {_mib(caps.host or 0)}, no disk); "
                    "lower chunk_numel, raise a budget or give disk_dir"
                )
            used[spare] += n
            out.append(spare)
    return out
