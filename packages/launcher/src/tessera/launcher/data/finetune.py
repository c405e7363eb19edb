"""Fine-tuning data: the examples of a ``.jsonl`` file (`finetune_examples`: read, then
tokenized with the loss on the responses only) in fixed-length rows, and global batches of
them in a seeded order, the same on every rank.

**Targets.** Row position j holds input ``ids[j] = tokens[j]`` and target ``targets[j] =
tokens[j + 1]`` when token j + 1 carries the loss, else -100 (``IGNORE_INDEX``): an example of
L tokens fills L - 1 positions (its first token is never a target, its last never an input).
Which tokens carry the loss: `finetune_examples` (a response and its eos; each assistant
message of a chat and the end-of-turn tokens its template writes after it).

**Rows.** Each example is truncated to ``seq_len`` positions (its tail is dropped, never moved
to another row; how many were truncated is logged once), and refused, naming its line, if
truncation would leave none of its response tokens. Without packing each example is a row;
with ``packing=True`` examples are laid end to end in file order, a new row begun when the
next example does not fit (so no example is split). Rows are padded to ``seq_len`` with the
tokenizer's pad id (else its eos, else 0) and -100 targets. Packed examples share a row and
the model's causal attention lets each see the examples before it in the row (no document
mask); ``FinetuneData.spans`` says where each example lies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tessera.launcher.data.finetune_examples import Encoded, encode_examples, pad_id, read_examples
from tessera.launcher.train.objective import IGNORE_INDEX

__all__ = ["FinetuneData", "build_rows", "finetune_data"]

log = logging.getLogger("tessera.data")


@dataclass(frozen=True, slots=True, eq=False)
class FinetuneData:
    """Fine-tuning rows: ``ids`` and ``targets`` (rows, seq_len) ``torch.long``, -100 where no
    loss counts; ``spans[k]`` = (row, start, length) of example k; the counts of examples,
    truncated examples and response tokens (targets that count); whether rows are packed."""

    ids: Tensor
    targets: Tensor
    spans: Tensor
    examples: int
    truncated: int
    response_tokens: int
    packed: bool

    def __post_init__(self) -> None:
        if self.ids.dtype != torch.long or self.targets.dtype != torch.long or self.ids.dim() != 2:
            raise ValueError(
                f"ids and targets must be 2-d torch.long, not {self.ids.dtype} {self.ids.dim()}-d"
            )
        if self.ids.shape != self.targets.shape or self.ids.shape[0] < 1:
            raise ValueError(
                f"ids {tuple(self.ids.shape)} and targets {tuple(self.targets.shape)} differ or are empty"
            )

    @property
    def rows(self) -> int:
        """How many rows."""
        return int(self.ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Positions per row."""
        return int(self.ids.shape[1])

    def order(self, seed: int, epoch: int) -> Tensor:
        """The rows in the order epoch ``epoch`` visits them: a permutation drawn from ``(seed,
        epoch)`` alone, so the same on every rank."""
        return torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(self.rows).astype(np.int64))

    def batch(
        self, step: int, batch_size: int, *, seed: int, rows: range | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(ids, targets)`` of global batch ``step`` (``rows``: only those of its rows, e.g. a
        data-parallel rank's): its row r is the global sample ``g = step * batch_size + r``, at
        position ``g mod R`` of epoch ``g div R``'s `order` (R: the data's rows), so each epoch
        sees every row once and a batch depends on (seed, step) alone."""
        if batch_size < 1 or step < 0:
            raise ValueError(f"batch_size={batch_size} must be >= 1 and step={step} >= 0")
        picked: list[int] = []
        orders: dict[int, Tensor] = {}
        for r in range(batch_size) if rows is None else rows:
            epoch, at = divmod(step * batch_size + r, self.rows)
            if epoch not in orders:
                orders[epoch] = self.order(seed, epoch)
            picked.append(int(orders[epoch][at]))
        index = torch.tensor(picked, dtype=torch.long)
        return self.ids.index_select(0, index), self.targets.index_select(0, index)

    def batches(
        self, batch_size: int, *, seed: int, steps: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Global batches ``start .. steps - 1`` (see `batch`)."""
        for step in range(start, steps):
            yield self.batch(step, batch_size, seed=seed)


def _place(lengths: Sequence[int], seq_len: int, packing: bool) -> list[tuple[int, int]]:
    """(row, start) of each example: one row each, or greedily end to end in order."""
    if not packing:
        return [(k, 0) for k in range(len(lengths))]
    places: list[tuple[int, int]] = []
    row = fill = 0
    for n in lengths:
        if fill and fill + n > seq_len:
            row, fill = row + 1, 0
        places.append((row, fill))
        fill += n
    return places


def build_rows(
    encoded: Sequence[Encoded], *, seq_len: int, pad_id: int, packing: bool = False
) -> FinetuneData:
    """Rows of ``seq_len`` positions from ``encoded`` (truncated, padded, optionally packed; see
    the module docstring); logs the truncation count once."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if not encoded:
        raise ValueError("no examples to make rows of")
    pieces: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
    truncated = dropped = 0
    for e in encoded:
        tokens, loss = np.asarray(e.tokens, dtype=np.int64), np.asarray(e.loss, dtype=bool)
        counted = np.flatnonzero(loss[1:])
        if not len(counted):
            raise ValueError(
                f"{e.where}: none of its {len(tokens)} tokens is a response token after the first"
            )
        n = len(tokens) - 1
        if n > seq_len:
            if counted[0] >= seq_len:
                raise ValueError(
                    f"{e.where}: its first response token is token {counted[0] + 2} of {len(tokens)}, but a "
                    f"row of seq_len={seq_len} keeps only the first {seq_len + 1} (the last as a target), so "
                    "truncation would cut off every response token; shorten the prompt or raise seq_len"
                )
            truncated, dropped, n = truncated + 1, dropped + n - seq_len, seq_len
        pieces.append((tokens[:n], np.where(loss[1 : n + 1], tokens[1 : n + 1], IGNORE_INDEX)))
    places = _place([len(ids) for ids, _ in pieces], seq_len, packing)
    rows = places[-1][0] + 1
    ids = np.full((rows, seq_len), pad_id, dtype=np.int64)
    targets = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    for (row, start), (x, y) in zip(places, pieces, strict=True):
        ids[row, start : start + len(x)], targets[row, start : start + len(y)] = x, y
    spans = torch.tensor([(row, start, len(x)) for (row, start), (x, _) in zip(places, pieces, strict=True)])
    response = int((targets != IGNORE_INDEX).sum())
    if truncated:
        log.warning(
            "fine-tuning data: %d of %d examples are longer than seq_len=%d and were truncated (%d tokens "
            "dropped)",
            truncated,
            len(encoded),
            seq_len,
            dropped,
        )
    log.info(
        "fine-tuning data: %d examples in %d rows of %d (%s), %d response tokens (%.1f%% of the positions)",
        len(encoded),
        rows,
        seq_len,
        "packed" if packing else "one example a row",
        response,
        100.0 * response / (rows * seq_len),
    )
    return FinetuneData(
        torch.from_numpy(ids), torch.from_numpy(targets), spans, len(encoded), truncated, response, packing
    )


def finetune_data(
    path: str | Path,
    tokenizer: Any,
    *,
    seq_len: int,
    packing: bool = False,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
) -> FinetuneData:
    """The rows of the ``.jsonl`` file ``path`` for ``tokenizer`` (a Hugging Face tokenizer): read
    (`read_examples`), encoded (`encode_examples`) and laid out (`build_rows`); every mistake a
    ValueError with one line naming the file and line."""
    examples = read_examples(
        path, prompt_field=prompt_field, response_field=response_field, messages_field=messages_field
    )
    encoded = encode_examples(examples, tokenizer)
    return build_rows(encoded, seq_len=seq_len, pad_id=pad_id(tokenizer), packing=packing)
