"""``TESSERA_SHM``: whether CPU collectives among the ranks of one host go through shared
memory (`tessera.comm.shm`). Importable without torch, so the launcher checks the value
before it spawns anything."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ENV", "enabled_from_env"]

ENV = "TESSERA_SHM"
_ON, _OFF = ("auto", "1", "on"), ("0", "off")


def enabled_from_env(env: Mapping[str, str]) -> bool:
    """False when ``env`` turns shared-memory collectives off (``0``/``off``), True when it
    leaves them on (unset, ``auto``, ``1``, ``on``: used wherever a group's ranks share a
    host); ValueError naming the variable for anything else."""
    raw = env.get(ENV, "auto").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(_ON + _OFF)}")
