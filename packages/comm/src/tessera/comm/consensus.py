"""Fail together: every rank learns whether any rank failed, and why, before the next collective.

A rank that raises on its own (a corrupt checkpoint shard, a disk error) while the others go
on into a collective leaves them waiting until the timeout. ``raise_together`` is one small
all-gather that every rank reaches, with or without an error, after which every rank raises:
the failing ranks their own error, the others a `RemoteFailure` that names the first failing
rank and quotes its error, so every rank's log says what went wrong in one line.
"""

from __future__ import annotations

import torch

from tessera.comm.collectives import Group, all_gather, group_rank, group_size

__all__ = ["MESSAGE_BYTES", "RemoteFailure", "raise_together"]

MESSAGE_BYTES = 480
"""How much of the failing rank's error text travels (UTF-8, cut at this many bytes)."""


class RemoteFailure(RuntimeError):
    """Raised on the ranks that were fine when another rank of the group failed."""


def _encode(error: BaseException | None) -> torch.Tensor:
    out = torch.zeros(MESSAGE_BYTES + 1, dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
        out[0] = 1
        out[1 : 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out


def _decode(row: torch.Tensor) -> str:
    return bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="replace")


def raise_together(
    error: BaseException | None, group: Group, what: str, device: torch.device | None = None
) -> None:
    """Raise on every rank of ``group`` if any rank passes an ``error`` (collective).

    The failing ranks raise their own error; the others raise `RemoteFailure` naming how many
    ranks failed, the first of them (its rank in ``group``) and its error text. Moves
    ``MESSAGE_BYTES + 1`` bytes per rank (one all-gather).
    """
    mine = _encode(error).to(device if device is not None else "cpu").reshape(1, -1)
    rows = all_gather(mine, group).cpu().view(group_size(group), -1)
    failed = [r for r in range(rows.shape[0]) if int(rows[r, 0])]
    if error is not None:
        raise error
    if failed:
        first = failed[0]
        raise RemoteFailure(
            f"{what} failed on {len(failed)} rank(s) (this is rank {group_rank(group)}); "
            f"rank {first}: {_decode(rows[first])}"
        )
