"""The main job's data: a character corpus every machine has, a tokenizer, deterministic batches.

The default corpus is the Python standard library's own top-level source files (read in
sorted order, so every rank and every run sees the same text). Batches are a pure function
of (seed, split, step): the data position of a run is just its step count, so a resumed
run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import Tensor

from tessera.launcher.data.corpus import load_corpus

__all__ = ["CharTokenizer", "TextData", "load_corpus", "pair"]


@dataclass(frozen=True, slots=True)
class CharTokenizer:
    """Characters to ids and back; the vocabulary is the sorted set of the corpus's characters."""

    chars: str

    @classmethod
    def fit(cls, text: str) -> CharTokenizer:
        """The tokenizer of every character in ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Ids of ``text`` (characters outside the vocabulary raise KeyError)."""
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> str:
        """The text of ``ids``."""
        values = ids.tolist() if isinstance(ids, Tensor) else ids
        return "".join(self.chars[i] for i in values)

    def to_json(self) -> str:
        """The tokenizer as JSON (saved beside checkpoints)."""
        return json.dumps({"chars": self.chars})

    @classmethod
    def from_json(cls, text: str) -> CharTokenizer:
        """Inverse of to_json."""
        return cls(json.loads(text)["chars"])


class TextData:
    """A tokenized corpus split into train and validation, with seeded batches."""

    def __init__(self, text: str, *, val_fraction: float, seq_len: int, seed: int) -> None:
        self.tokenizer = CharTokenizer.fit(text)
        ids = self.tokenizer.encode(text)
        cut = int(len(ids) * (1.0 - val_fraction))
        self.splits = {"train": ids[:cut], "val": ids[cut:]}
        for name, part in self.splits.items():
            if len(part) <= seq_len + 1:
                raise ValueError(f"the {name} split has {len(part)} tokens, too few for seq_len={seq_len}")
        self.seq_len = seq_len
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        """Ids the model needs: the tokenizer's characters."""
        return self.tokenizer.vocab_size

    @property
    def tokens(self) -> int:
        """Tokens in both splits (characters)."""
        return sum(len(part) for part in self.splits.values())

    def batch(
        self, split: str, step: int, batch_size: int, *, rows: range | None = None
    ) -> tuple[Tensor, Tensor]:
        """Batch ``step`` of ``split`` (``rows``: only those rows): ``(inputs, targets)`` of
        shape (rows, seq_len)."""
        x, y = self.parts(split, step, batch_size, rows=rows)
        assert x is not None and y is not None
        return x, y

    def parts(
        self,
        split: str,
        step: int,
        batch_size: int,
        *,
        rows: range | None = None,
        needs: tuple[bool, bool] = (True, True),
    ) -> tuple[Tensor | None, Tensor | None]:
        """The inputs and the targets of rows ``rows`` (default all) of batch ``step``, each
        only if ``needs`` asks for it (None otherwise; nothing is read when neither is): a
        rank builds only what its engine reads (``Engine.local_rows``, ``Engine.batch_needs``)."""
        if not any(needs):
            return None, None
        ids = self.splits[split]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "val"))
        starts = torch.randint(0, len(ids) - self.seq_len - 1, (batch_size,), generator=gen).tolist()
        picked = starts if rows is None else [starts[r] for r in rows]
        block = torch.stack([ids[s : s + self.seq_len + 1] for s in picked])
        return pair(block, needs)


def pair(block: Tensor, needs: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """Inputs (every token but the last of each row) and targets (but the first) of ``block``,
    each only if ``needs`` asks for it."""
    x = block[:, :-1].contiguous() if needs[0] else None
    y = block[:, 1:].contiguous() if needs[1] else None
    return x, y
