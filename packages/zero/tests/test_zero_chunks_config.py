"""Tier 0: the chunk manager's settings are checked in one place (``chunk_problems``).

``ChunkConfig`` raises what ``chunk_problems`` finds; the launcher reports the same lines
for its ``[zero]`` section (with a ``zero.`` prefix) before anything spawns.
"""

from __future__ import annotations

import pytest

from tessera.zero import ChunkConfig, chunk_problems


def _problems(**kw: object) -> list[str]:
    settings: dict[str, object] = dict(
        device_budget_mb=None,
        host_budget_mb=None,
        disk_dir=None,
        policy="static",
        fractions=None,
        chunk_numel=None,
    )
    settings.update(kw)
    return chunk_problems(**settings)  # type: ignore[arg-type]


def test_every_mistake_is_one_line_naming_the_value() -> None:
    assert _problems() == []
    assert _problems(host_budget_mb=-2.0, policy="greedy", chunk_numel=-1) == [
        "host_budget_mb=-2.0 must be >= 0 (0: not limited / not used)",
        "policy='greedy' is not one of static, auto",
        "chunk_numel must be >= 0, got -1",
    ]
    assert _problems(fractions=(0.5, 0.6, 0.0), prefix="zero.") == [
        "zero.fractions=[0.5, 0.6, 0.0] must sum to 1, not 1.1"
    ]
    assert _problems(fractions=(0.0, 0.5, 0.5), policy="auto", disk_dir="d") == [
        "fractions are for policy='static'; 'auto' places by measured free memory"
    ]
    assert _problems(fractions=(0.0, 0.0, 1.0)) == [
        "fractions=[0.0, 0.0, 1.0] puts chunks on disk but disk_dir is empty"
    ]


def test_the_config_raises_what_the_check_finds() -> None:
    with pytest.raises(
        ValueError, match=r"fractions=\[0.0, 0.0, 1.0\] puts chunks on disk but disk_dir is empty"
    ):
        ChunkConfig(fractions=(0.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="policy='lru' is not one of static, auto"):
        ChunkConfig(policy="lru")  # type: ignore[arg-type]
    assert ChunkConfig(disk_dir="d", fractions=(0.0, 0.0, 1.0)).numel_for(10_000, 16) > 0
    assert ChunkConfig(chunk_numel=0).numel_for(10_000, 16) == ChunkConfig().numel_for(10_000, 16)
