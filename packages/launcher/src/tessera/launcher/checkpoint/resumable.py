"""Whether ``train.resume`` can be resumed, checked by the launcher before any rank starts (no torch).

``train.resume`` must name a committed generation (``generations``: itself, or the newest under
it) whose files are all there and match the checksums of its manifest; for the main job, it
must have been saved under this run's configuration but for the layout (``fingerprint``: the
degrees and ZeRO may change, the state reshards), and its vocabulary must split over
``parallel.tp``. Each mistake is one line starting with ``train.resume=...``. The engine's loader
checks the same again on every rank, and what only a built engine knows (a change of the
degrees or ZeRO settings under the same layout, the shapes of the model's tensors).

Every file is hashed, several at once: a resume reads the checkpoint once more here. On
several nodes a file this node does not hold may be on another node's disk (checkpoint
folders that are not shared, ``storage``): only the files present are checked.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tessera.launcher.checkpoint.fingerprint import LAYOUT_SECTIONS, differences, fingerprint, sha256
from tessera.launcher.checkpoint.generations import (
    MANIFEST,
    committed_checkpoint,
    committed_generations,
    read_manifest,
    saved_vocab,
)
from tessera.launcher.config import Config

__all__ = ["resume_problems"]


def _digest(path: Path) -> str | OSError:
    try:
        return sha256(path)
    except OSError as exc:
        return exc


def _file_problem(generation: Path, files: dict[str, str], *, all_here: bool) -> str | None:
    """The first file of ``files`` missing (when ``all_here``) or not matching its checksum."""
    names = sorted(files)
    missing = [rel for rel in names if not (generation / rel).is_file()]
    if missing and all_here:
        return f"{generation / missing[0]} is missing (listed in its {MANIFEST})"
    present = [rel for rel in names if rel not in missing]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        digests = pool.map(lambda rel: _digest(generation / rel), present)  # hashlib drops the GIL
        for rel, digest in zip(present, digests, strict=True):
            if isinstance(digest, OSError):
                return f"{generation / rel} cannot be read ({digest.strerror})"
            if digest != files[rel]:
                return (
                    f"{generation / rel} does not match its checksum in {MANIFEST} (changed or cut short "
                    "after it was saved)"
                )
    return None


def _earlier(generation: Path) -> str:
    """Where to resume instead: the committed generation before ``generation``, if any."""
    before = [g for g in committed_generations(generation.parent) if g.name < generation.name]
    return f"; the generation before it is {str(before[-1])!r}" if before else ""


def _config_problems(config: Config, resume: str, generation: Path, saved: Any) -> list[str]:
    """This run's configuration against the one ``generation`` was saved under, but the layout."""
    vocab = config.model.vocab_size or saved_vocab(resume)  # the job's rule (``job.main_job``)
    resumed = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))
    mine = {k: v for k, v in fingerprint(resumed).items() if k not in LAYOUT_SECTIONS}
    if not isinstance(saved, dict):
        return [f"{generation / MANIFEST} records no configuration"]
    changed = differences({k: v for k, v in saved.items() if k not in LAYOUT_SECTIONS}, mine)
    if changed:
        return [f"{generation} was saved under another configuration: {'; '.join(changed[:6])}"]
    return []


def resume_problems(config: Config, *, main_job: bool, nodes: int = 1) -> list[str]:
    """Why ``train.resume`` cannot be resumed, one line each (module docstring); ``main_job``:
    also the configuration and the vocabulary; ``nodes``: the nodes of the job (on several, only
    the files present here are checked)."""
    resume = config.train.resume
    where = f"train.resume={resume!r}"
    if not resume:
        return []
    if not Path(resume).exists():
        return [f"{where} does not exist"]
    generation = committed_checkpoint(resume)
    if generation is None:
        return [
            f"{where} holds no committed checkpoint (a {MANIFEST}, in it or in a step-N/ generation under it)"
        ]
    manifest = read_manifest(generation)
    files = manifest.get("files")
    errors = []
    if not isinstance(files, dict):
        errors.append(f"{where}: {generation / MANIFEST} lists no files")
    else:
        bad = _file_problem(generation, files, all_here=nodes == 1)
        if bad:
            errors.append(f"{where}: {bad}{_earlier(generation)}")
    if not main_job:
        return errors
    errors += [
        f"{where}: {line}" for line in _config_problems(config, resume, generation, manifest.get("config"))
    ]
    if not config.model.vocab_size:  # the saved vocabulary is the one to resume
        vocab, tp = saved_vocab(resume), config.parallel.tp
        if vocab % tp:
            errors.append(
                f"{where}: its vocabulary of {vocab} does not split over parallel.tp={tp}; resume under a tp "
                "that divides it, or start runs with --set model.vocab_size=N, a multiple of every tp to "
                "resume under"
            )
    return errors
