"""Tier 1: the parameter bytes each rank holds after ``parallelize`` with each tensor-parallel
plan, on threaded ranks, equal the layout's share of the serial GPT's exactly.

A rank's parameter bytes are the storage bytes of its parameters (``tessera.comm.storage_bytes``,
each storage once); they also equal the sum of numel * 4 (fp32), so no shard is a view
that keeps a larger storage alive. S = the serial GPT's parameter bytes, P = tp ranks.

- 1D (``GPT_PLAN``, tp=P): (S - R)/P + R, where R are the parameters every rank keeps whole:
  the LayerNorms' weights and biases (ln1, ln2 of each layer, ln_f), the position embedding
  (``sequence_split`` only splits its output under SP) and, with bias=True, the row-parallel
  layers' biases (out_proj.bias, fc_out.bias, added after the all-reduce). Everything else
  (the vocab-split token embedding, q/k/v/fc_in rows and biases, out_proj/fc_out columns,
  the vocab-split LM head) is cut P ways.
- 2D (``GPT_2D_PLAN``, P = q*q): S/(q*q); Linear weights split on both dimensions, biases,
  norm affines and the hidden-split embeddings cut q*q ways: nothing replicated.
- 2.5D (``GPT_2P5D_PLAN``, P = q*q*d): S/(q*q); each depth layer holds the 2D split, the
  weights are replicated over the d depth layers.
- 3D (``GPT_3D_PLAN``, P = q**3): S/q**3; weights, biases, norm affines and embeddings all cut
  q**3 ways.
"""

from __future__ import annotations

import pytest
from torch import nn

from tessera.comm import Mesh, Topology, TPMode, storage_bytes
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import parallelize
from tessera.tensor_parallel.testing import gpt_plan

E = 4  # fp32 bytes


def _cfg(bias: bool) -> GPTConfig:
    return GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=8, n_layers=2, bias=bias)


def _bytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * E for p in params)


def _rank_bytes(rank: int, mode: str, tp: int, depth: int, bias: bool) -> tuple[int, int]:
    mesh = Mesh(Topology(tp=tp, tp_mode=TPMode(mode), tp_depth=depth))
    model = parallelize(GPT(_cfg(bias), seed=0), plan=gpt_plan(mesh), mesh=mesh)
    params = list(model.parameters())
    return storage_bytes(params), _bytes(params)


def _replicated_1d(model: GPT) -> int:
    """Bytes of the parameters 1D keeps whole on every rank."""
    whole = []
    for name, p in model.named_parameters():
        norm = ".ln" in name or name.startswith("ln")
        row_bias = name.endswith(("attn.out_proj.bias", "mlp.fc_out.bias"))
        if norm or row_bias or name == "embed.pos.weight":
            whole.append(p)
    return _bytes(whole)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_1d_holds_its_share_plus_the_replicated(tp: int, bias: bool) -> None:
    serial = GPT(_cfg(bias), seed=0)
    s, r = _bytes(list(serial.parameters())), _replicated_1d(serial)
    assert (s - r) % tp == 0
    expect = (s - r) // tp + r
    assert r == (2 * 2 + 1) * 2 * 32 * E + 8 * 32 * E + (2 * 2 * 32 * E if bias else 0)
    for stored, counted in run_threaded(tp, _rank_bytes, "1d", tp, 1, bias):
        assert stored == counted == expect


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("mode", "tp", "depth", "share"),
    [("2d", 4, 1, 4), ("2.5d", 8, 2, 4), ("3d", 8, 1, 8)],
    ids=["2d-q2", "2.5d-q2-d2", "3d-q2"],
)
def test_nd_holds_exactly_its_share(mode: str, tp: int, depth: int, share: int, bias: bool) -> None:
    s = _bytes(list(GPT(_cfg(bias), seed=0).parameters()))
    assert s % share == 0
    for stored, counted in run_threaded(tp, _rank_bytes, mode, tp, depth, bias):
        assert stored == counted == s // share
