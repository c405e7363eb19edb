"""Whether a file of text data holds text: UTF-8, no NUL byte, few control characters (no torch).

The main job reads its text (``data.corpus``; the ``.txt`` and ``.jsonl`` files of ``data.path``)
as UTF-8. Read with replacement characters, a file that is not text (binary data, another
encoding) would become a vocabulary of thousands of "characters" and train on noise without a
word; `text_problem` and `read_text` say so instead, in one line naming the file and the byte
offset, before anything spawns. Text is refused at the first byte that is not valid UTF-8, at
the first NUL byte (binary formats and UTF-16 have them; no text does), or when more than
``CONTROL_SHARE`` of its bytes are control characters other than tab, newline, carriage
return, vertical tab, form feed and escape (which text does hold: Python sources have form
feeds, logs have colour escapes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CONTROL_SHARE", "read_text", "text_problem"]

CONTROL_SHARE = 0.1
_BLOCK = 1 << 20
_CONTROL = bytes([*range(1, 9), *range(14, 27), *range(28, 32), 127])
_FIND_CONTROL = re.compile(b"[" + re.escape(_CONTROL) + b"]")


class _Scan:
    """Blocks of one file fed in order; ``problem`` is the first reason it is not text."""

    def __init__(self, where: str, path: Path) -> None:
        self.head = f"{where}: {path}"
        self.offset = 0  # bytes of the file before ``carry``
        self.carry = b""  # the start of a character cut by the block's end
        self.controls = 0
        self.first_control = -1
        self.problem: str | None = None

    def feed(self, block: bytes, *, last: bool = False) -> None:
        data = self.carry + block
        self.carry = b""
        bad = -1  # the first byte that is not UTF-8
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data" and exc.end == len(data) and not last:
                self.carry = data[exc.start :]  # a character the next block completes
                data = data[: exc.start]
            else:
                bad = exc.start
        nul = data.find(b"\0")
        if nul >= 0 and (bad < 0 or nul < bad):
            at = self.offset + nul
            self.problem = (
                f"{self.head} is not text: byte offset {at} is a NUL byte (binary data, or UTF-16?)"
            )
            return
        if bad >= 0:
            self.problem = (
                f"{self.head} is not UTF-8 text: byte offset {self.offset + bad} (0x{data[bad]:02x}) is not "
                "valid UTF-8 (binary data, or another encoding: convert it to UTF-8)"
            )
            return
        found = len(data) - len(data.translate(None, _CONTROL))
        if found and self.first_control < 0:
            match = _FIND_CONTROL.search(data)
            self.first_control = self.offset + (match.start() if match else 0)
        self.controls += found
        self.offset += len(data)
        if last and self.offset and self.controls > CONTROL_SHARE * self.offset:
            self.problem = (
                f"{self.head} is not text: {100 * self.controls / self.offset:.0f}% of its bytes are control "
                f"characters (the first at byte offset {self.first_control})"
            )


def _scan(where: str, path: Path, blocks: Iterable[bytes]) -> str | None:
    scan = _Scan(where, path)
    for block in blocks:
        scan.feed(block)
        if scan.problem:
            return scan.problem
    scan.feed(b"", last=True)
    return scan.problem


def _blocks(path: Path) -> Iterable[bytes]:
    with path.open("rb") as fh:
        yield from iter(lambda: fh.read(_BLOCK), b"")


def text_problem(path: Path, where: str) -> str | None:
    """Why ``path`` is not UTF-8 text, one line starting with ``where`` and naming the file
    and the byte offset; None when it is text (read a block at a time)."""
    try:
        return _scan(where, path, _blocks(path))
    except OSError as exc:
        return f"{where}: {path} cannot be read ({exc.strerror})"


def read_text(path: Path, where: str) -> str:
    """The text of ``path``; ValueError with `text_problem`'s line when it is not text."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: {path} cannot be read ({exc.strerror})") from None
    problem = _scan(where, path, [data])
    if problem:
        raise ValueError(problem)
    return data.decode("utf-8")
