"""Checkpoint generations on disk, without torch: which ones exist, which are committed.

A checkpoint root holds one directory per save, ``step-NNNNNNNN/``, committed by its
``manifest.json`` (written last); ``latest`` names the newest committed one. This module is
what the launcher checks before spawning anything, and what ``checkpoint`` saves and loads
through, so the rule of what counts as committed lives here only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "committed_checkpoint",
    "committed_generations",
    "generation_name",
    "read_manifest",
    "resolve_generation",
    "saved_vocab",
]

FORMAT = "tessera-engine/3"
MANIFEST = "manifest.json"
LATEST = "latest"


def generation_name(step: int) -> str:
    """The directory name of the generation saved at ``step``."""
    return f"step-{step:08d}"


def read_manifest(generation: Path) -> dict[str, Any]:
    """The manifest of a generation directory (ValueError unless it is one of this format)."""
    path = generation / MANIFEST
    manifest: dict[str, Any] = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if generation.name != generation_name(int(manifest["step"])):
        raise ValueError(f"{path} says step {manifest['step']} but lies in {generation.name}")
    return manifest


def committed_generations(root: str | Path) -> list[Path]:
    """The committed generations under ``root``, oldest first (torn saves are skipped)."""
    out = []
    for gen in sorted(Path(root).glob("step-*")):
        try:
            read_manifest(gen)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(gen)
    return out


def resolve_generation(path: str | Path) -> Path:
    """``path`` itself if it is a committed generation, else the newest one under it."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        read_manifest(path)
        return path
    found = committed_generations(path)
    if not found:
        raise ValueError(f"{path} holds no committed checkpoint generation (step-*/{MANIFEST})")
    return found[-1]


def committed_checkpoint(path: str | Path) -> Path | None:
    """The committed checkpoint generation at ``path`` (itself, or the newest ``step-N/`` under
    it; torn saves are passed over), or None when there is none: the rule of
    ``resolve_generation``, which the checkpoint loader uses too."""
    try:
        return resolve_generation(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_vocab(resume: str | Path) -> int:
    """The vocabulary the main job trained with, as the newest committed generation at
    ``resume`` records it (its configuration's ``model.vocab_size``; 0 when it does not say,
    as older checkpoints do, or there is no generation)."""
    generation = committed_checkpoint(resume)
    if generation is None:
        return 0
    try:
        return int(read_manifest(generation)["config"]["model"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
