"""Fail together: every rank learns whether any rank failed before the next collective.

A rank that raises on its own (a corrupt checkpoint shard, a disk error) while the others go
on into a collective leaves them waiting until the timeout. ``raise_together`` is one small
all-reduce that every rank reaches, with or without an error, after which every rank raises.
"""

from __future__ import annotations

import torch

from tessera.comm.collectives import Group, all_reduce

__all__ = ["RemoteFailure", "raise_together"]


class RemoteFailure(RuntimeError):
    """Raised on the ranks that were fine when another rank of the group failed."""


def raise_together(
    error: BaseException | None, group: Group, what: str, device: torch.device | None = None
) -> None:
    """Raise on every rank of ``group`` if any rank passes an ``error`` (collective).

    The failing ranks raise their own error; the others raise `RemoteFailure` naming how many
    ranks failed and ``what`` they were doing. Moves 4 bytes per rank (one all-reduce).
    """
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    failed = int(all_reduce(flag, group, "sum").item())
    if error is not None:
        raise error
    if failed:
        raise RemoteFailure(f"{what} failed on {failed} other rank(s); their logs name the cause")
