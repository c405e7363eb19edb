"""Tier 0 and 2: the sequence-split probe (``context/probe.py``) refuses what it must and passes
what works.

``RopeLM`` is a small Llama-style model (token embedding, 2 layers of RMSNorm, attention with
rotary q/k and ``F.scaled_dot_product_attention(is_causal=True)``, MLP, a head). Built with
``inline=True`` its attention computes cos/sin from ``torch.arange(t)`` of the length it is
handed: at cp=2 each rank's slice starts its positions at 0, so ``context_parallelize(...,
probe=...)`` must refuse it on every rank (none may hang), naming ``layers.0.attn`` (the first
module whose output differs while its input does not: not its projection ``wo`` after it, not
the layer around it). Built with ``inline=False`` the same arithmetic sits in a ``Rotary``
module, found by class and made to follow the shards: the probe passes (no false alarm),
logs its cost, and leaves the training flags as they were. Both under ring (contiguous and
zigzag) and Ulysses. The probe's own bound (1e-4 of the output's largest magnitude in fp32)
is explained in ``probe.py``: ring vs SDPA round-off <= 3.1e-7 against 3e-2 for the inline
rotary; these tests assert which side of it each model falls on.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.tensor_parallel.context import SequenceProbe, context_parallelize

VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2
MODES = [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag")]
ADVICE = "its forward derives positions or a mask from the local sequence length"


def _angles(t: int, head_dim: int) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Rotary(nn.Module):
    """cos and sin (seq, head_dim) for the positions of ``x``'s sequence (dim 1)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return _angles(x.shape[1], self.head_dim)


class Attention(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.inline, self.head_dim = inline, DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.rope = None if inline else Rotary(self.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        cos, sin = _angles(t, self.head_dim) if self.rope is None else self.rope(x)
        q, k, v = (w(x).view(b, t, HEADS, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True)
        out: Tensor = self.wo(y.transpose(1, 2).reshape(b, t, DIM))
        return out


class Layer(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(DIM), Attention(inline)
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class RopeLM(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(inline) for _ in range(LAYERS))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        gen = torch.Generator().manual_seed(0)  # the same weights on every rank
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1 and not p.is_meta:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.head(self.norm(h))
        return out


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _probed(rank: int, inline: bool, meta: bool = False) -> list[tuple[str, list[str], bool]]:
    """Per mode: the ValueError's text (or "passed"), the probe's log lines, and whether every
    module is back in training mode."""
    logger = logging.getLogger("tessera.tensor_parallel.context.probe")
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out = []
    try:
        for mode, layout in MODES:
            lines.lines.clear()
            with torch.device("meta" if meta else "cpu"):
                model = RopeLM(inline)
            try:
                context_parallelize(
                    model, None, mode=mode, layout=layout, cores=None, positions=None,
                    probe=SequenceProbe(vocab_size=VOCAB),
                )  # fmt: skip
                result = "passed"
            except ValueError as e:
                result = str(e)
            out.append((result, list(lines.lines), all(m.training for m in model.modules())))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return out


def test_positions_from_the_local_length_are_refused_on_every_rank(worker_pools: PoolFactory) -> None:
    for per_rank in worker_pools(2).run(_probed, True, timeout=120):
        for (mode, layout), (result, _, _) in zip(MODES, per_rank, strict=True):
            assert f"at cp=2 ({layout} layout)" in result, (mode, result)
            assert "the first module whose output differs is 'layers.0.attn' (Attention)" in result, result
            assert ADVICE in result and "ModelSpec(positions=...)" in result


def test_a_rotary_module_passes_and_the_cost_is_logged(worker_pools: PoolFactory) -> None:
    for per_rank in worker_pools(2).run(_probed, False, timeout=120):
        for (mode, layout), (result, lines, training) in zip(MODES, per_rank, strict=True):
            assert result == "passed", (mode, layout, result)
            assert len(lines) == 1, lines
            assert lines[0].startswith(f"sequence-split probe: RopeLM at cp=2 ({layout}), 2 x 16 tokens")
            assert training, "the probe left modules in eval mode"


def test_a_model_on_the_meta_device_is_not_probed(worker_pools: PoolFactory) -> None:
    for per_rank in worker_pools(2).run(_probed, True, True, timeout=120):
        for result, lines, _ in per_rank:
            assert result == "passed"
            assert lines == [
                "sequence-split probe skipped: RopeLM has parameters on the meta device (deferred init)"
            ]


@pytest.mark.parametrize(
    ("cp", "layout", "probe", "limit", "want"),
    [
        (2, "contiguous", SequenceProbe(vocab_size=8), None, 16),
        (2, "zigzag", SequenceProbe(vocab_size=8, length=5), None, 8),  # rounded up to 4 chunks
        (4, "zigzag", SequenceProbe(vocab_size=8, multiple=3), None, 24),  # 8 chunks, each cut by 3
        (2, "zigzag", SequenceProbe(vocab_size=8, max_len=10), None, 8),
        (2, "zigzag", SequenceProbe(vocab_size=8), 6, 4),  # a learned position embedding of 6
        (4, "zigzag", SequenceProbe(vocab_size=8), 6, 0),  # nothing fits: not probed
    ],
)
def test_the_probe_length_fits_the_layout(
    cp: int, layout: str, probe: SequenceProbe, limit: int | None, want: int
) -> None:
    assert probe.sequence_length(cp, layout, limit) == want


def test_every_rank_draws_the_same_ids() -> None:
    probe = SequenceProbe(vocab_size=5, batch=1)
    a, b = probe.ids(8, torch.device("cpu")), probe.ids(8, torch.device("cpu"))
    assert a.shape == (1, 8) and torch.equal(a, b) and int(a.max()) < 5
    with pytest.raises(ValueError, match=r"SequenceProbe\.vocab_size must be >= 1, got 0"):
        SequenceProbe(vocab_size=0)
