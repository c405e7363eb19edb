"""``tessera prepare-data``: the user's text tokenized once into token shards (no torch).

The text files of ``data.path`` (`data_sources`) are tokenized with ``data.tokenizer``
(`text_tokenizers`; "char" first reads the text once to fit its vocabulary) into
``tokens-NNNNN.bin`` shards (flat ``uint16`` ids, ``uint32`` for vocabularies over 65,536) in
``data.prepared`` (default ``<train.run_dir>/data/<name>-<hash of path, tokenizer, field>``),
with ``meta.json`` written last (the commit point): the tokenizer's record, vocabulary size,
dtype, token and document counts, the shards, and the sources it was made from (path, size and
mtime of each file), so a changed source makes it stale. The folder is itself pre-tokenized
data: ``data.path`` may name it.

``tessera train`` prepares the data itself when the shards are missing or stale, before any
rank starts; pre-tokenized ``.bin`` data is read where it is. `problems` is what the
launcher checks before either: one line per mistake, naming the file and the line or offset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tessera.comm.files import atomic_write, publish
from tessera.launcher.config import Config
from tessera.launcher.data.data_sources import (
    DTYPES,
    SIDECAR,
    TokenFiles,
    check_token_file,
    documents,
    is_token_data,
    source_files,
    token_files,
)
from tessera.launcher.data.text_check import text_problem
from tessera.launcher.data.text_tokenizers import (
    ByteVocab,
    CharVocab,
    HFTokenizer,
    Tokenizer,
    tokenizer_problem,
)

__all__ = [
    "SHARD_TOKENS",
    "ensure_prepared",
    "open_tokens",
    "prepare",
    "prepare_command",
    "prepared_dir",
    "problems",
    "split_problems",
    "split_sizes",
]

log = logging.getLogger("tessera.data")

SHARD_TOKENS = 1 << 26  # tokens per shard (128 MiB of uint16)
FORMAT = 1


def prepared_dir(config: Config) -> Path:
    """Where the shards of ``data.path`` go: ``data.prepared``, or a folder under
    ``train.run_dir/data`` named by the path and a hash of (path, tokenizer, field)."""
    d = config.data
    if d.prepared:
        return Path(d.prepared)
    key = json.dumps([str(Path(d.path).resolve()), d.tokenizer, d.field])
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(d.path.split("*")[0] or ".").resolve().name) or "data"
    return Path(config.train.run_dir) / "data" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _sources(config: Config, files: list[Path]) -> dict[str, Any]:
    """What the shards are made from: a change to any of it makes them stale."""
    d = config.data

    def stat(f: Path) -> list[Any]:
        s = f.stat()
        return [str(f.resolve()), s.st_size, s.st_mtime_ns]

    tokenizer = stat(Path(d.tokenizer)) if d.tokenizer not in ("char", "byte") else d.tokenizer
    return {"files": [stat(f) for f in files], "tokenizer": tokenizer, "field": d.field}


def _fresh_meta(config: Config, files: list[Path]) -> dict[str, Any] | None:
    """The committed meta.json of the prepared shards, if they were made from ``files`` as
    they are now with this tokenizer and field; else None."""
    path = prepared_dir(config) / SIDECAR
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    return meta if meta.get("sources") == _sources(config, files) else None


def _tokenizer(config: Config, files: list[Path]) -> Tokenizer:
    spec = config.data.tokenizer
    if spec == "byte":
        return ByteVocab()
    if spec == "char":
        log.info("prepare-data: reading %d file(s) to fit the character vocabulary", len(files))
        return CharVocab.fit(documents(files, config.data.field))
    return HFTokenizer(spec)


class _ShardWriter:
    """Ids appended into ``tokens-NNNNN.bin`` shards of at most ``limit`` tokens each."""

    def __init__(self, folder: Path, dtype: str, limit: int) -> None:
        self.folder, self.dtype, self.limit = folder, DTYPES[dtype], limit
        self.shards: list[dict[str, Any]] = []
        self._fh: Any = None
        self._count = 0

    def _open(self) -> None:
        name = f"tokens-{len(self.shards):05d}.bin"
        self.shards.append({"file": name, "tokens": 0})
        self._fh = (self.folder / f".{name}.tmp").open("wb")
        self._count = 0

    def _close(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        name = self.shards[-1]["file"]
        publish(self.folder / f".{name}.tmp", self.folder / name)

    def write(self, ids: np.ndarray[Any, Any]) -> None:
        while len(ids):
            if self._fh is None:
                self._open()
            take = min(len(ids), self.limit - self._count)
            self._fh.write(ids[:take].astype(self.dtype).tobytes())
            self._count += take
            self.shards[-1]["tokens"] = self._count
            ids = ids[take:]
            if self._count == self.limit:
                self._close()

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards


def prepare(config: Config, *, shard_tokens: int = SHARD_TOKENS) -> dict[str, Any]:
    """Tokenize the text of ``data.path`` into shards in `prepared_dir`; returns the meta it
    committed. Logs a progress line (logger ``tessera.data``) at most once a second."""
    d = config.data
    files = source_files(d.path)
    if is_token_data(files):
        raise ValueError(f"data.path={d.path!r} is already tokenized (.bin files): nothing to prepare")
    folder = prepared_dir(config)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SIDECAR).unlink(missing_ok=True)  # uncommitted while the shards are rewritten
    for old in folder.glob("tokens-*.bin"):
        old.unlink()
    tokenizer = _tokenizer(config, files)
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    writer = _ShardWriter(folder, dtype, shard_tokens)
    total_bytes = sum(f.stat().st_size for f in files) or 1
    started = last = time.perf_counter()
    tokens = docs = done_bytes = 0
    for i, f in enumerate(files):
        for text in documents([f], d.field):
            ids = tokenizer.encode(text)
            writer.write(ids)
            tokens += len(ids)
            docs += 1
        done_bytes += f.stat().st_size
        now = time.perf_counter()
        if now - last >= 1.0 or i == len(files) - 1:
            last = now
            log.info(
                "prepare-data: %d/%d files, %d documents, %d tokens (%.0f%% of the bytes, %.1f s)",
                i + 1,
                len(files),
                docs,
                tokens,
                100.0 * done_bytes / total_bytes,
                now - started,
            )
    meta = {
        "format": FORMAT,
        "tokenizer": tokenizer.record(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "tokens": tokens,
        "documents": docs,
        "shards": writer.finish(),
        "sources": _sources(config, files),
    }
    atomic_write(folder / SIDECAR, json.dumps(meta, indent=1).encode())
    return meta


def split_sizes(tokens: int, val_fraction: float) -> tuple[int, int]:
    """Tokens of the train and the validation split: validation is the stream's last
    ``val_fraction`` (the rule of the default corpus, `data.TextData`)."""
    cut = int(tokens * (1.0 - val_fraction))
    return cut, tokens - cut


def split_problems(config: Config, tokens: int, where: str) -> list[str]:
    """The splits of ``tokens`` (``data.val_fraction``) too short for ``model.seq_len``, one line
    each starting with ``where``: a batch row needs ``seq_len + 1`` tokens and a choice of start."""
    seq_len, fraction = config.model.seq_len, config.data.val_fraction
    return [
        f"{where}: the {name} split has {n} tokens (of {tokens}, data.val_fraction={fraction}), too few "
        f"for model.seq_len={seq_len}"
        for name, n in zip(("train", "val"), split_sizes(tokens, fraction), strict=True)
        if n <= seq_len + 1
    ]


def _size_problems(config: Config, tokens: int, vocab: int) -> list[str]:
    errors = split_problems(config, tokens, f"data.path={config.data.path!r}")
    if config.model.vocab_size and config.model.vocab_size < vocab:
        errors.append(
            f"model.vocab_size={config.model.vocab_size} is smaller than the {vocab} ids of "
            f"data.path={config.data.path!r} (0: take it from the data)"
        )
    return errors


def open_tokens(config: Config) -> TokenFiles:
    """The token files the main job reads: ``data.path`` itself when it is pre-tokenized, else
    its committed fresh shards (ValueError telling to run ``tessera prepare-data`` if none)."""
    d = config.data
    files = source_files(d.path)
    if is_token_data(files):
        vocab = config.model.vocab_size
        return token_files(files, token_dtype=d.token_dtype, tokenizer=d.tokenizer, vocab_size=vocab)
    meta = _fresh_meta(config, files)
    if meta is None:
        raise ValueError(
            f"data.path={d.path!r} has no prepared shards in {str(prepared_dir(config))!r} (or they are "
            "stale): run tessera prepare-data with this configuration"
        )
    folder = prepared_dir(config)
    shards = [s for s in meta["shards"] if s["tokens"]]
    return TokenFiles(
        tuple(folder / s["file"] for s in shards),
        tuple(int(s["tokens"]) for s in shards),
        str(meta["dtype"]),
        int(meta["vocab_size"]),
        dict(meta["tokenizer"]),
    )


def problems(config: Config) -> list[str]:
    """Every mistake in ``[data]`` with ``data.path`` set, one line each, before anything
    spawns: the path, the files, the tokenizer, the dtype, each token file's ids against the
    vocabulary, that each text file is UTF-8 text (``text_check``) and each JSON line's field
    (unless fresh shards exist), and the split sizes."""
    d = config.data
    errors = []
    if d.token_dtype not in ("", *DTYPES):
        errors.append(f"data.token_dtype={d.token_dtype!r} is not one of {', '.join(DTYPES)} (or empty)")
    tok = tokenizer_problem(d.tokenizer)
    errors += [tok] if tok else []
    try:
        files = source_files(d.path)
    except ValueError as exc:
        return [*errors, str(exc)]
    if errors:
        return errors
    try:
        if is_token_data(files):
            found = token_files(
                files, token_dtype=d.token_dtype, tokenizer=d.tokenizer, vocab_size=config.model.vocab_size
            )
            for f in found.files:
                bad = check_token_file(f, found.dtype, found.vocab_size)
                if bad:
                    return [bad]
            return _size_problems(config, found.tokens, found.vocab_size)
        meta = _fresh_meta(config, files)
        if meta is not None:
            return _size_problems(config, int(meta["tokens"]), int(meta["vocab_size"]))
        for f in files:  # binary data or another encoding would tokenize into noise
            bad = text_problem(f, "data.path")
            if bad:
                return [bad]
        for _ in documents([f for f in files if f.suffix == ".jsonl"], d.field):  # each line's field
            pass
    except ValueError as exc:
        return [str(exc)]
    return []


def ensure_prepared(config: Config, say: Callable[[str], None]) -> list[str]:
    """Before ``tessera train`` spawns: prepare the shards of text data that has none fresh
    (``say`` reports it and the progress), then check the split sizes; one line per mistake."""
    d = config.data
    if not d.path:
        return []
    try:
        files = source_files(d.path)
        if is_token_data(files):
            return []
        meta = _fresh_meta(config, files)
        if meta is None:
            say(f"data.path={d.path!r}: tokenizing into {prepared_dir(config)} (once; tessera prepare-data)")
            with _forwarded(say):
                meta = prepare(config)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    return _size_problems(config, int(meta["tokens"]), int(meta["vocab_size"]))


class _Say(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


class _forwarded:
    """The ``tessera.data`` log lines go to ``say`` (the CLI's stderr) while this is open."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.handler = _Say(say)
        self.level = log.level

    def __enter__(self) -> None:
        log.addHandler(self.handler)
        log.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        log.removeHandler(self.handler)
        log.setLevel(self.level)


def prepare_command(config: Config, say: Callable[[str], None]) -> int:
    """``tessera prepare-data``: check, tokenize, report; the exit code (2: refused)."""
    if not config.data.path:
        say("data.path is empty: the main job's built-in corpus needs no preparing (set data.path)")
        return 2
    errors = problems(config)
    if not errors and is_token_data(source_files(config.data.path)):
        say(f"data.path={config.data.path!r} is already tokenized (.bin): the main job reads it where it is")
        return 0
    if not errors:
        try:
            with _forwarded(say):
                meta = prepare(config)
        except (OSError, ValueError) as exc:
            errors = [str(exc)]
    if errors:
        for line in errors:
            say(line)
        return 2
    errors = _size_problems(config, int(meta["tokens"]), int(meta["vocab_size"]))
    for line in errors:
        say(f"warning: {line}")
    say(
        f"prepared {meta['tokens']} tokens ({meta['documents']} documents, vocabulary {meta['vocab_size']}, "
        f"{meta['dtype']}, {len(meta['shards'])} shard(s)) in {prepared_dir(config)}"
    )
    return 0
