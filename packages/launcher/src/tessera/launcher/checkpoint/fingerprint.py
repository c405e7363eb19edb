"""What a checkpoint generation must agree with to be resumed, without torch.

A generation's manifest records the configuration that shapes its state (`fingerprint`) and
the sha256 of every file (`sha256`). The engine's loader compares both on every rank; the
launcher compares the same, with the same functions, before any rank starts
(``checkpoint.vetting``), so the rule lives here once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tessera.launcher.config import BoostConfig, Config
from tessera.launcher.config.config_io import config_to_dict

__all__ = ["LAYOUT_SECTIONS", "differences", "fingerprint", "sha256"]

# Fields that choose where or how the state lives but not what it is: a resume may change them
# (a chunked run's checkpoint loads unchunked, under another disk directory or budget; the
# split tuning only orders the halves of each backward; a step in backward only takes it earlier).
_PLACEMENT_ONLY = {
    "parallel": ("auto", "cluster", "tune_splits"),
    "zero": (
        "host_budget_mb",
        "device_budget_mb",
        "disk_dir",
        "policy",
        "fractions",
        "chunk_numel",
        "step_in_backward",
    ),
}

LAYOUT_SECTIONS = ("parallel", "zero")
"""The sections a resume under another layout may change (the state reshards)."""


def fingerprint(config: BoostConfig) -> dict[str, Any]:
    """The configuration that shapes the saved state, as plain values (a choice is its name): a
    resume under another one is refused. A `Config` adds the main job's ``[model]`` and what
    its data position counts."""
    plain = config_to_dict(config)
    out: dict[str, Any] = {n: plain[n] for n in ("parallel", "zero", "model", "optim") if n in plain}
    for section, names in _PLACEMENT_ONLY.items():
        for name in names:
            out[section].pop(name, None)
    if out["parallel"].get("ep") == 1:  # without expert parallelism: as saved before parallel.ep
        del out["parallel"]["ep"]
    if isinstance(config, Config):
        out["data"] = {"corpus": config.data.corpus, "batch_size": config.data.batch_size}
        if config.data.path:  # the user's own data: its samples are what the data position counts
            out["data"].update(path=config.data.path, tokenizer=config.data.tokenizer)
    out["train"] = {"seed": config.train.seed, "precision": str(config.train.precision)}
    return out


def differences(saved: dict[str, Any], mine: dict[str, Any], prefix: str = "") -> list[str]:
    """What differs, for the keys this run's fingerprint has (a key only an older checkpoint
    recorded, such as ``parallel.auto``, no longer shapes the state; a section the saved one
    lacks, ``[model]`` of a job saved from a `BoostConfig`, was not the saver's to shape)."""
    lines = []
    for key in sorted(mine):
        if not prefix and key not in saved:
            continue
        a, b = saved.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: saved {a!r}, now {b!r}")
    return lines


def sha256(path: Path) -> str:
    """The hex sha256 of a file, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
