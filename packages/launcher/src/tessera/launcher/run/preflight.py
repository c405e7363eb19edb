"""What the launcher checks on disk before anything spawns (torch is not imported).

`Config.validate` checks the numbers; this checks the world they point at: that a resume
path holds a committed checkpoint, that the run folder can be written, and, for the main
job, that the corpus exists, that an explicit ``model.vocab_size`` covers its alphabet and
that the free disk holds its disk tier and a checkpoint (``disk_space``).
Each mistake is one line naming the field and its value.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.launcher.checkpoint.generations import MANIFEST, committed_checkpoint, saved_vocab
from tessera.launcher.config import Config
from tessera.launcher.config.verify_rules import verify_problems
from tessera.launcher.data.corpus import load_corpus
from tessera.launcher.data.prepare import problems as data_problems
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


def preflight(config: Config, *, main_job: bool, processes: int = 0) -> list[str]:
    """Every mistake the disk shows before a job of ``config`` spawns, one line each.

    ``main_job``: also read the corpus (``data.corpus``, ``data.max_chars``) and check
    ``model.vocab_size`` against its alphabet, or with ``data.path`` the user's data; and the
    free disk for its disk tier and a checkpoint (``disk_space``; ``processes``: the ranks on
    this machine, 0: the whole world).
    """
    errors = _writable_dir("train.run_dir", config.train.run_dir)
    if config.train.verify:
        errors += verify_problems(config, main_job=main_job)
    if config.zero.disk_dir:
        errors += _writable_dir("zero.disk_dir", config.zero.disk_dir)
    resume = config.train.resume
    if resume:
        if not Path(resume).exists():
            errors.append(f"train.resume={resume!r} does not exist")
        elif committed_checkpoint(resume) is None:
            errors.append(
                f"train.resume={resume!r} holds no committed checkpoint (a {MANIFEST}, in it or in a "
                "step-N/ generation under it)"
            )
        elif main_job and not config.model.vocab_size:  # the saved vocabulary is the one to resume
            vocab, tp = saved_vocab(resume), config.parallel.tp
            if vocab % tp:
                errors.append(
                    f"train.resume={resume!r}: its vocabulary of {vocab} does not split over "
                    f"parallel.tp={tp}; resume under a tp that divides it, or start runs with --set "
                    "model.vocab_size=N, a multiple of every tp to resume under"
                )
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
    return errors
