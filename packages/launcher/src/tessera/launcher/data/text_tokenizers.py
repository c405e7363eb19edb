"""The tokenizers of ``data.tokenizer`` for the user's own data (torch is not imported).

- ``"char"``: the vocabulary is the sorted set of the data's characters (fitted when the data
  is prepared; the main job's default corpus has its own `data.CharTokenizer`).
- ``"byte"``: the 256 values of the UTF-8 bytes.
- a path to a Hugging Face ``tokenizer.json``: loaded with the ``tokenizers`` package, which
  is optional (``pip install tokenizers``); without it the job is refused before it starts.

Each tokenizer is described by a small JSON record (``record()``), kept in the prepared
data's ``meta.json``, so the main job rebuilds exactly the tokenizer the shards were made with
(`from_record`). Encoding returns numpy ids.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ByteVocab",
    "CharVocab",
    "HFTokenizer",
    "IdVocab",
    "Tokenizer",
    "from_record",
    "have_tokenizers",
    "tokenizer_problem",
]

Ids = NDArray[np.int64]


class Tokenizer(Protocol):
    """Text to ids and back, with a JSON record that rebuilds it."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> Ids: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def record(self) -> dict[str, Any]: ...

    def to_json(self) -> str: ...


class CharVocab:
    """Characters to ids: the sorted characters of the text it was fitted on."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self._points = np.frombuffer(chars.encode("utf-32-le"), dtype=np.uint32)

    @classmethod
    def fit(cls, texts: Iterable[str]) -> CharVocab:
        """The vocabulary of every character in ``texts``."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls("".join(sorted(seen)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Ids:
        """Ids of ``text``; ValueError naming a character outside the vocabulary."""
        points = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        if len(points) and not len(self._points):
            raise ValueError(f"character {text[0]!r} is not in the (empty) vocabulary")
        ids = np.searchsorted(self._points, points)
        bad = (ids >= len(self._points)) | (self._points[np.minimum(ids, len(self._points) - 1)] != points)
        if len(points) and bad.any():
            first = int(np.argmax(bad))
            raise ValueError(f"character {text[first]!r} is not in the vocabulary")
        return ids.astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def record(self) -> dict[str, Any]:
        return {"kind": "char", "chars": self.chars}

    def to_json(self) -> str:
        return json.dumps(self.record())


class ByteVocab:
    """The UTF-8 bytes of the text: 256 ids, nothing to fit."""

    vocab_size = 256

    def encode(self, text: str) -> Ids:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def record(self) -> dict[str, Any]:
        return {"kind": "byte"}

    def to_json(self) -> str:
        return json.dumps(self.record())


class IdVocab:
    """Pre-tokenized data whose tokenizer is unknown: ids written as numbers."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> Ids:
        return np.array([int(w) for w in text.split()], dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def record(self) -> dict[str, Any]:
        return {"kind": "ids", "vocab_size": self.vocab_size}

    def to_json(self) -> str:
        return json.dumps(self.record())


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, through the optional ``tokenizers`` package."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.text = Path(path).read_text(encoding="utf-8")
        module: Any = importlib.import_module("tokenizers")
        self._tok: Any = module.Tokenizer.from_str(self.text)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> Ids:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids]))

    def record(self) -> dict[str, Any]:
        return {"kind": "hf", "path": str(Path(self.path).resolve())}

    def to_json(self) -> str:
        return self.text


def have_tokenizers() -> bool:
    """Whether the optional ``tokenizers`` package is installed."""
    return importlib.util.find_spec("tokenizers") is not None


def tokenizer_problem(spec: str) -> str | None:
    """Why ``data.tokenizer=spec`` cannot be used (one line), or None."""
    if spec in ("char", "byte"):
        return None
    path = Path(spec)
    if not path.is_file():
        return (
            f"data.tokenizer={spec!r} is not 'char', 'byte' or the path of a Hugging Face tokenizer.json "
            "(no such file)"
        )
    if not have_tokenizers():
        return (
            f"data.tokenizer={spec!r} is a Hugging Face tokenizer, which needs the optional 'tokenizers' "
            "package: pip install tokenizers (or use 'char' / 'byte')"
        )
    try:
        HFTokenizer(spec)
    except Exception as exc:  # the tokenizers package raises its own exception types
        return f"data.tokenizer={spec!r} cannot be loaded by tokenizers: {str(exc).splitlines()[0]}"
    return None


def from_record(record: dict[str, Any]) -> Tokenizer:
    """The tokenizer a ``record()`` describes (ValueError naming an unknown kind)."""
    kind = record.get("kind")
    if kind == "char":
        return CharVocab(str(record["chars"]))
    if kind == "byte":
        return ByteVocab()
    if kind == "hf":
        return HFTokenizer(str(record["path"]))
    if kind == "ids":
        return IdVocab(int(record["vocab_size"]))
    raise ValueError(f"unknown tokenizer record {record!r}")
