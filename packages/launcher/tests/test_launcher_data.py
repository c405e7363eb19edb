"""Tier 0: the main job's corpus, tokenizer, deterministic batches, metrics and plot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.launcher.data.chars import CharTokenizer, TextData, load_corpus
from tessera.launcher.job.runlog import MetricsWriter, plot_metrics, read_metrics


def test_stdlib_corpus_is_deterministic_and_capped() -> None:
    a = load_corpus("stdlib", 50_000)
    assert a == load_corpus("stdlib", 50_000)
    assert len(a) == 50_000
    assert "def " in a


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither 'stdlib', a file nor a directory"):
        load_corpus(str(tmp_path / "nope"), 10)
    small = tmp_path / "small.txt"
    small.write_text("abc")
    with pytest.raises(ValueError, match="holds only 3 characters"):
        load_corpus(str(small), 10_000)


@given(st.text(min_size=1, max_size=200))
def test_tokenizer_round_trips(text: str) -> None:
    tok = CharTokenizer.fit(text)
    assert tok.decode(tok.encode(text)) == text
    assert CharTokenizer.from_json(tok.to_json()) == tok


def test_batches_are_a_function_of_the_step() -> None:
    data = TextData(load_corpus("stdlib", 20_000), val_fraction=0.1, seq_len=16, seed=3)
    x1, y1 = data.batch("train", 5, 4)
    x2, y2 = data.batch("train", 5, 4)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(data.batch("train", 6, 4)[0], x1)
    assert not torch.equal(data.batch("val", 5, 4)[0], x1)
    assert int(x1.max()) < data.tokenizer.vocab_size


def test_metrics_and_plot(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        writer.write(step=step, loss=4.0 / step, tokens_per_s=1000.0 + step)
    writer.write(step=5, val_loss=1.1)
    writer.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5]
    plot_metrics(records, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
