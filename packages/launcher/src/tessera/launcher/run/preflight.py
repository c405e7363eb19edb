"""What the launcher checks on disk before anything spawns (torch is not imported).

`Config.validate` checks the numbers; this checks the world they point at: that a resume
path holds a committed checkpoint whose files match their checksums (for the main job, saved
under this configuration: ``checkpoint.resumable``), that the run folder can be written, and,
for the main job, that the corpus exists and is text, that an explicit ``model.vocab_size``
covers its alphabet, that both splits are longer than ``model.seq_len``, and that the free
disk holds its disk tier and a checkpoint (``disk_space``).
Each mistake is one line naming the field and its value.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.launcher.checkpoint.resumable import resume_problems
from tessera.launcher.config import Config
from tessera.launcher.config.verify_rules import verify_problems
from tessera.launcher.data.corpus import load_corpus
from tessera.launcher.data.prepare import problems as data_problems
from tessera.launcher.data.prepare import split_problems
from tessera.launcher.run.disk_space import disk_problems

__all__ = ["preflight"]


def _writable_dir(field: str, value: str) -> list[str]:
    path = Path(value)
    if path.exists() and not path.is_dir():
        return [f"{field}={value!r} is a file, not a directory"]
    existing = path
    while not existing.exists():  # the nearest ancestor that exists must let us create it
        existing = existing.parent
    if not existing.is_dir():
        return [f"{field}={value!r}: {str(existing)!r} is a file, not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{field}={value!r}: {str(existing)!r} is not writable"]
    return []


def preflight(config: Config, *, main_job: bool, processes: int = 0, nodes: int = 1) -> list[str]:
    """Every mistake the disk shows before a job of ``config`` spawns, one line each.

    ``main_job``: also read the corpus (``data.corpus``, ``data.max_chars``) and check
    ``model.vocab_size`` against its alphabet and ``model.seq_len`` against its splits, or with
    ``data.path`` the user's data; a resumed checkpoint's configuration; and the free disk for
    its disk tier and a checkpoint (``disk_space``; ``processes``: the ranks on this machine,
    0: the whole world). ``nodes``: the job's nodes (``resume_problems``).
    """
    errors = _writable_dir("train.run_dir", config.train.run_dir)
    if config.train.verify:
        errors += verify_problems(config, main_job=main_job)
    if config.zero.disk_dir:
        errors += _writable_dir("zero.disk_dir", config.zero.disk_dir)
    errors += resume_problems(config, main_job=main_job, nodes=nodes)
    if main_job:
        errors += disk_problems(config, processes or config.world_size)
    if main_job and config.data.path:  # the user's own data (``tessera.launcher.data.prepare``)
        errors += data_problems(config)
    elif main_job:
        try:
            text = load_corpus(config.data.corpus, config.data.max_chars)
        except ValueError as exc:
            errors.append(str(exc))
        else:
            vocab = config.model.vocab_size
            alphabet = len(set(text))
            if vocab and vocab < alphabet:
                errors.append(
                    f"model.vocab_size={vocab} is smaller than the {alphabet} distinct characters of "
                    f"data.corpus={config.data.corpus!r} (0: take it from the corpus)"
                )
            errors += split_problems(config, len(text), f"data.corpus={config.data.corpus!r}")
    return errors
