"""The reference GPT alone: shapes, determinism, the layer stack the pipeline cuts, and that
the package imports nothing of Tessera (it sits below every other package)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.models import GPT, GPTConfig, make_batch


@settings(deadline=None)  # a model's forward: its time depends on the machine's load, not the code
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 8),
    heads=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
)
def test_logits_shape_and_chain_of_blocks(batch: int, seq: int, heads: int, layers: int) -> None:
    """The forward is ``head(layers(embed(idx)))``: chaining ``blocks()`` gives the same logits
    bit for bit (the same operations in the same order)."""
    cfg = GPTConfig(vocab_size=11, seq_len=8, d_model=8, n_heads=heads, n_layers=layers)
    model = GPT(cfg, seed=3)
    idx = torch.randint(0, 11, (batch, seq), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (batch, seq, 11)
    x = idx
    for block in model.blocks():
        x = block(x)
    assert torch.equal(x, logits)


def test_the_seed_alone_decides_the_weights() -> None:
    cfg = GPTConfig()
    torch.manual_seed(123)
    a = GPT(cfg, seed=5)
    torch.manual_seed(456)
    b = GPT(cfg, seed=5)
    c = GPT(cfg, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and ".ln" not in name:
            assert not torch.equal(pa, pc), name


def test_make_batch_is_shifted_and_deterministic() -> None:
    idx, targets = make_batch(GPTConfig(vocab_size=7, seq_len=5), 3, seed=1)
    again, _ = make_batch(GPTConfig(vocab_size=7, seq_len=5), 3, seed=1)
    assert idx.shape == targets.shape == (3, 5)
    assert torch.equal(idx[:, 1:], targets[:, :-1]) and torch.equal(idx, again)


def test_the_initial_loss_is_near_log_vocab() -> None:
    """Small initial weights: the untrained model guesses about uniformly over the vocabulary."""
    cfg = GPTConfig(n_layers=3)
    loss = GPT(cfg, seed=3).loss(*make_batch(cfg, 4, seed=0))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5


def test_a_bad_size_is_one_line() -> None:
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=4"):
        GPTConfig(d_model=10, n_heads=4)


def test_the_package_imports_nothing_of_tessera() -> None:
    root = Path(__file__).parents[1] / "src" / "tessera" / "models"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tessera."):
                assert node.module.startswith("tessera.models"), f"{path.name} imports {node.module}"
