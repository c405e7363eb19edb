"""The main job's text, read without torch: "stdlib", a text file, or a directory of sources.

The launcher reads it before anything spawns (to refuse a corpus that is missing, too small or
not text, a ``model.vocab_size`` smaller than its alphabet, or splits too short for
``model.seq_len``); ``data.TextData`` tokenizes it inside the job.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from tessera.launcher.data.text_check import read_text

__all__ = ["MIN_CHARS", "corpus_files", "load_corpus"]

MIN_CHARS = 1000


def corpus_files(spec: str) -> list[Path]:
    """The files of ``spec`` in reading order (ValueError naming it when it names nothing)."""
    if spec == "stdlib":
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted([*path.rglob("*.py"), *path.rglob("*.txt")])
    raise ValueError(f"data.corpus={spec!r} is neither 'stdlib', a file nor a directory")


def load_corpus(spec: str, max_chars: int) -> str:
    """The text named by ``spec``: "stdlib", a text file, or a directory of .py/.txt files."""
    parts: list[str] = []
    total = 0
    for f in corpus_files(spec):
        text = read_text(f, f"data.corpus={spec!r}")  # refuses what is not UTF-8 text (``text_check``)
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    corpus = "".join(parts)[:max_chars]
    if len(corpus) < MIN_CHARS:
        raise ValueError(
            f"data.corpus={spec!r} holds only {len(corpus)} characters; need at least {MIN_CHARS}"
        )
    return corpus
