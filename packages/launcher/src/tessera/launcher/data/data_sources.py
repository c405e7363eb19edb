"""The files of ``data.path`` and what they hold (torch is not imported).

``data.path`` is a file, a folder (searched recursively) or a glob (a matched folder is
searched too) of ``.txt`` and ``.jsonl`` files (text: one document per ``.txt`` file, one per
JSON line, its text under ``data.field``) or of ``.bin`` token files (a flat array of
``uint16`` / ``uint32`` token ids, as nanoGPT and Megatron write them; the dtype from
``data.token_dtype`` or a ``meta.json`` beside them, the format `tessera prepare-data`
writes). Files are taken in sorted order, so every rank and every run sees the same stream.
A folder or glob that mixes text and token files is refused. Every function here raises
ValueError with one line naming the file (and the line or offset).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.launcher.data.text_tokenizers import HFTokenizer

__all__ = [
    "DTYPES",
    "SIDECAR",
    "TokenFiles",
    "check_token_file",
    "documents",
    "source_files",
    "token_files",
]

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIX = ".bin"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SIDECAR = "meta.json"
_BLOCK = 1 << 22  # characters of a .txt file per piece; tokens per scanned block of a .bin file


def _kinds() -> str:
    return f"{', '.join(TEXT_SUFFIXES)} or {TOKEN_SUFFIX}"


def source_files(path: str) -> list[Path]:
    """The data files ``path`` names, sorted; ValueError when it names none, or mixes kinds."""
    known = (*TEXT_SUFFIXES, TOKEN_SUFFIX)
    where = f"data.path={path!r}"
    if any(c in path for c in "*?["):
        matches = [Path(p) for p in glob.glob(path, recursive=True)]
        found = {f for m in matches for f in ([m] if m.is_file() else m.rglob("*")) if f.is_file()}
        files = sorted(f for f in found if f.suffix in known)  # a matched folder: its files
        if not files:
            raise ValueError(f"{where} matches no {_kinds()} files")
    elif Path(path).is_file():
        if Path(path).suffix not in known:
            raise ValueError(f"{where} is not a {_kinds()} file")
        files = [Path(path)]
    elif Path(path).is_dir():
        files = sorted(f for f in Path(path).rglob("*") if f.is_file() and f.suffix in known)
        if not files:
            raise ValueError(f"{where} is a folder with no {_kinds()} files in it")
    else:
        raise ValueError(f"{where} does not exist")
    tokens = [f for f in files if f.suffix == TOKEN_SUFFIX]
    if tokens and len(tokens) != len(files):
        text = next(f for f in files if f.suffix != TOKEN_SUFFIX)
        raise ValueError(f"{where} mixes token files ({tokens[0]}) and text files ({text}); use one kind")
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"{where}: {f} is empty")
    return files


def is_token_data(files: list[Path]) -> bool:
    """Whether ``files`` are pre-tokenized ``.bin`` files (else text)."""
    return bool(files) and files[0].suffix == TOKEN_SUFFIX


def _ended(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def _text_pieces(f: Path) -> Iterator[str]:
    """A .txt file in pieces of whole lines (about ``_BLOCK`` characters), ending with a newline."""
    with f.open(encoding="utf-8", errors="replace") as fh:
        piece: list[str] = []
        size = 0
        for line in fh:
            piece.append(line)
            size += len(line)
            if size >= _BLOCK:
                yield "".join(piece)
                piece, size = [], 0
        if piece:
            yield _ended("".join(piece))


def _json_texts(f: Path, field: str) -> Iterator[str]:
    """The ``field`` text of every non-blank line of a .jsonl file, each ending with a newline."""
    found = False
    with f.open(encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.path: {f} line {n} is not JSON ({exc.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise ValueError(f"data.path: {f} line {n} has no field {field!r} (data.field={field!r})")
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"data.path: {f} line {n}: field {field!r} is a {type(text).__name__}, not a string"
                )
            found = True
            yield _ended(text)
    if not found:
        raise ValueError(f"data.path: {f} holds no JSON lines")


def documents(files: list[Path], field: str) -> Iterator[str]:
    """The text of ``files`` in order, in pieces that each end a line: a .txt file in pieces of
    whole lines, a .jsonl file one document per line (a newline ends each document)."""
    for f in files:
        yield from _json_texts(f, field) if f.suffix == ".jsonl" else _text_pieces(f)


@dataclass(frozen=True, slots=True)
class TokenFiles:
    """Pre-tokenized files and how to read them: dtype, vocabulary, tokenizer record, counts."""

    files: tuple[Path, ...]
    counts: tuple[int, ...]
    dtype: str
    vocab_size: int
    tokenizer: dict[str, Any]

    @property
    def tokens(self) -> int:
        """Tokens in all the files."""
        return sum(self.counts)


def _sidecar(files: list[Path]) -> dict[str, Any]:
    path = files[0].parent / SIDECAR
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"data.path: {path} cannot be read as JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"data.path: {path} is not a JSON object")
    return meta


def token_files(files: list[Path], *, token_dtype: str, tokenizer: str, vocab_size: int) -> TokenFiles:
    """How to read pre-tokenized ``files``: the dtype is ``token_dtype`` or the sidecar's; the
    vocabulary the sidecar's, else the tokenizer's (byte: 256, a tokenizer.json: its size),
    else ``vocab_size`` (``model.vocab_size``)."""
    meta = _sidecar(files)
    where = f"data.path: {files[0].parent}"
    dtype = token_dtype or str(meta.get("dtype", ""))
    if not dtype:
        raise ValueError(
            f"{where}: the token files' dtype is unknown; set data.token_dtype (uint16 or uint32) or "
            f'write {SIDECAR} beside them with a "dtype"'
        )
    if dtype not in DTYPES:
        raise ValueError(f"{where}: token dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    record: dict[str, Any] = meta.get("tokenizer") or {}
    vocab = int(meta.get("vocab_size", 0))
    if not record and tokenizer == "byte":
        record = {"kind": "byte"}
    elif not record and tokenizer != "char":
        record = {"kind": "hf", "path": str(Path(tokenizer).resolve())}
    if not vocab:
        if record.get("kind") == "byte":
            vocab = 256
        elif record.get("kind") == "hf":
            vocab = HFTokenizer(str(record["path"])).vocab_size
        else:
            vocab = vocab_size
    if not vocab:
        raise ValueError(
            f"{where}: the vocabulary size of the token files is unknown; set model.vocab_size, or "
            f'write {SIDECAR} beside them with a "vocab_size"'
        )
    if not record:
        record = {"kind": "ids", "vocab_size": vocab}
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    counts = []
    for f in files:
        size = f.stat().st_size
        if size % itemsize:
            raise ValueError(f"data.path: {f} holds {size} bytes, not a whole number of {dtype} tokens")
        counts.append(size // itemsize)
    return TokenFiles(tuple(files), tuple(counts), dtype, vocab, record)


def check_token_file(f: Path, dtype: str, vocab_size: int) -> str | None:
    """The first id in ``f`` that is >= ``vocab_size``, as one line naming the file and the
    offset (read a block at a time through a memmap), or None."""
    ids = np.memmap(f, dtype=DTYPES[dtype], mode="r")
    for start in range(0, len(ids), _BLOCK):
        block = ids[start : start + _BLOCK]
        bad = np.flatnonzero(block >= vocab_size)
        if len(bad):
            at = start + int(bad[0])
            return (
                f"data.path: {f} token {at} (byte offset {at * ids.itemsize}) is id {int(ids[at])}, not "
                f"below the vocabulary size {vocab_size}"
            )
    return None
