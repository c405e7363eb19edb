"""The main job's batches from token files: memmapped, shuffled by (seed, epoch), resumable.

The token files (`prepare.open_tokens`: the shards ``tessera prepare-data`` wrote, or the
user's own ``.bin`` files) are one stream in file order, opened as read-only numpy memmaps:
no rank reads the dataset into memory. The stream's last ``data.val_fraction`` is the
validation split. A split of L tokens holds N = (L - 1) // seq_len samples: sample k is the
``seq_len + 1`` tokens from k * seq_len (inputs, and targets shifted by one).

Row r of batch ``step`` is the split's global sample g = step * batch_size + r; it lies in
epoch g // N at position g % N of that epoch's order, a permutation of the N samples drawn
from ``numpy.random.default_rng([seed, epoch, split])``. So every epoch sees each sample
once, in an order fixed by the seed and the epoch, and a batch is a pure function of (seed,
step): the data position a checkpoint records (its step, ``manifest.json``'s
``data_position``) is all a resumed run needs to continue at the exact next sample.

What each rank reads: the main job asks its engine which rows its data-parallel replica
trains on (``Engine.local_rows``: the same rows on the tp / cp / pp ranks of one replica) and
whether it reads the inputs and the targets (``Engine.batch_needs``: a pipeline's first stage
the inputs, its last the targets, a middle stage neither), and ``parts`` reads just that:
``batch_size / dp`` samples of ``seq_len + 1`` tokens through the memmaps (the pages the OS
maps in), nothing on a middle stage, plus the epoch's order (8 bytes per sample, once per
epoch). The rows are those the global batch would give the replica, so the losses are the
same bit for bit.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from tessera.launcher.config import Config
from tessera.launcher.data.chars import TextData, load_corpus, pair
from tessera.launcher.data.data_sources import DTYPES, TokenFiles
from tessera.launcher.data.prepare import open_tokens, split_sizes
from tessera.launcher.data.text_tokenizers import Tokenizer, from_record

__all__ = ["Data", "TokenData", "open_data"]

_SPLITS = ("train", "val")


class TokenData:
    """Batches of ``seq_len`` tokens from memmapped token files (see the module docstring)."""

    def __init__(self, source: TokenFiles, *, val_fraction: float, seq_len: int, seed: int) -> None:
        self.source = source
        self.tokenizer: Tokenizer = from_record(source.tokenizer)
        self.vocab_size = source.vocab_size
        self.seq_len, self.seed = seq_len, seed
        self._starts = [0]
        for count in source.counts:
            self._starts.append(self._starts[-1] + count)
        self._maps: dict[int, NDArray[Any]] = {}
        train, val = split_sizes(self.tokens, val_fraction)
        self.bounds = {"train": (0, train), "val": (train, train + val)}
        self.samples = {name: (end - start - 1) // seq_len for name, (start, end) in self.bounds.items()}
        for name, n in self.samples.items():
            if n < 1:
                length = self.bounds[name][1] - self.bounds[name][0]
                raise ValueError(f"the {name} split has {length} tokens, too few for seq_len={seq_len}")
        self._orders: dict[tuple[str, int], NDArray[np.int64]] = {}

    @property
    def tokens(self) -> int:
        """Tokens in the whole stream (both splits)."""
        return self._starts[-1]

    def _map(self, i: int) -> NDArray[Any]:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.source.files[i], dtype=DTYPES[self.source.dtype], mode="r")
        return self._maps[i]

    def read(self, start: int, n: int) -> NDArray[np.int64]:
        """Tokens ``start .. start + n - 1`` of the stream (across file boundaries)."""
        out = np.empty(n, dtype=np.int64)
        i = bisect.bisect_right(self._starts, start) - 1
        done = 0
        while done < n:
            ids = self._map(i)
            at = start + done - self._starts[i]
            take = min(n - done, len(ids) - at)
            out[done : done + take] = ids[at : at + take]
            done += take
            i += 1
        return out

    def order(self, split: str, epoch: int) -> NDArray[np.int64]:
        """The samples of ``split`` in the order epoch ``epoch`` visits them."""
        key = (split, epoch)
        if key not in self._orders:
            if len(self._orders) >= 4:  # an epoch's order and the next, per split
                self._orders.pop(next(iter(self._orders)))
            gen = np.random.default_rng([self.seed, epoch, _SPLITS.index(split)])
            self._orders[key] = gen.permutation(self.samples[split]).astype(np.int64)
        return self._orders[key]

    def position(self, split: str, step: int, batch_size: int) -> tuple[int, int]:
        """(epoch, position in its order) of the first row of batch ``step``."""
        return divmod(step * batch_size, self.samples[split])

    def sample_indices(self, split: str, step: int, batch_size: int, rows: range | None = None) -> list[int]:
        """The samples of rows ``rows`` (default all) of batch ``step`` of ``split``."""
        out = []
        for r in range(batch_size) if rows is None else rows:
            epoch, at = divmod(step * batch_size + r, self.samples[split])
            out.append(int(self.order(split, epoch)[at]))
        return out

    def batch(
        self, split: str, step: int, batch_size: int, *, rows: range | None = None
    ) -> tuple[Tensor, Tensor]:
        """Batch ``step`` of ``split`` (``rows``: only those rows): ``(inputs, targets)`` of
        shape (rows, seq_len), int64."""
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
        only if ``needs`` asks for it (None otherwise; no token is read when neither is)."""
        if not any(needs):
            return None, None
        start = self.bounds[split][0]
        windows = [
            self.read(start + k * self.seq_len, self.seq_len + 1)
            for k in self.sample_indices(split, step, batch_size, rows)
        ]
        return pair(torch.from_numpy(np.stack(windows)), needs)

    def prompt(self, tokens: int = 4) -> str:
        """The first ``tokens`` tokens of the validation split, as text: a prompt for a sample
        that the tokenizer can encode."""
        return self.tokenizer.decode(self.read(self.bounds["val"][0], tokens).tolist())


Data = TextData | TokenData  # what the main job trains on


def open_data(config: Config) -> Data:
    """The main job's data: the built-in corpus (``data.corpus``) when ``data.path`` is empty,
    else the token files of ``data.path``."""
    d = config.data
    if not d.path:
        return TextData(
            load_corpus(d.corpus, d.max_chars),
            val_fraction=d.val_fraction,
            seq_len=config.model.seq_len,
            seed=config.train.seed,
        )
    return TokenData(
        open_tokens(config), val_fraction=d.val_fraction, seq_len=config.model.seq_len, seed=config.train.seed
    )
