"""Tier 1: the activation bytes each rank saves for backward in the reference GPT equal the
formulas of ``activation_bytes_1d`` / ``_2d`` / ``_2p5d`` / ``_3d``, per transformer block and
for the embedding and head, exactly (hypothesis over batch, sequence, hidden, heads, MLP
ratio, vocabulary, layers, q (2 or 3 for 2D and 2.5D, 2 for 3D), the 2.5D depth; ranks as threads).

Measured as the formulas count: the storages of the tensors autograd saves during one
forward of the mode's loss (a ``saved_tensors_hooks`` pack hook), each storage once by its
``data_ptr``, the rank's parameters excluded; a storage is attributed to the block whose
forward saved it first, anything saved outside the blocks to the embedding and head. The
count is integer arithmetic over shapes, so the bound is equality (the issue asks for 2%):
nothing pads. fp32, dropout 0, CPU flash attention, as the formulas state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode, storage_bytes
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import parallelize
from tessera.tensor_parallel.activations import ActivationBytes, activation_bytes_1d
from tessera.tensor_parallel.testing import gpt_loss, gpt_plan
from tessera.tensor_parallel.three_d import activation_bytes_3d
from tessera.tensor_parallel.two_d import activation_bytes_2d
from tessera.tensor_parallel.two_p5_d import activation_bytes_2p5d


@st.composite
def case(draw: st.DrawFn, mode: str) -> dict[str, Any]:
    """A GPT and grid for ``mode``: q (or tp) divides the heads and vocab, the grid's batch
    split divides the batch, and q^2 (2D, 2.5D) or q^3 (3D) the hidden (the sharded affines)."""
    n = draw(st.sampled_from({"1d": [2, 4], "2d": [2, 3], "2.5d": [2, 3], "3d": [2]}[mode]))
    depth = draw(st.sampled_from([1, 2])) if mode == "2.5d" else 1
    batch_split = {"1d": 1, "2d": n, "2.5d": n * depth, "3d": n * n}[mode]
    hidden_split = {"1d": n, "2d": n * n, "2.5d": n * n, "3d": n**3}[mode]
    heads = n * draw(st.integers(1, 2))
    hidden = heads * hidden_split * draw(st.integers(1, 2))
    return {
        "mode": mode,
        "q": n,
        "depth": depth,
        "tp": {"1d": n, "2d": n * n, "2.5d": n * n * depth, "3d": n**3}[mode],
        "batch": batch_split * draw(st.integers(1, 2)),
        "cfg": GPTConfig(
            vocab_size=n * n * draw(st.integers(1, 4)),
            seq_len=draw(st.integers(1, 6)),
            d_model=hidden,
            n_heads=heads,
            n_layers=draw(st.integers(1, 2)),
            mlp_ratio=draw(st.integers(1, 4)),
            bias=draw(st.booleans()),
        ),
    }


def formula(c: dict[str, Any]) -> ActivationBytes:
    cfg: GPTConfig = c["cfg"]
    shape = {
        "batch": c["batch"],
        "seq": cfg.seq_len,
        "hidden": cfg.d_model,
        "heads": cfg.n_heads,
        "vocab": cfg.vocab_size,
        "mlp_ratio": cfg.mlp_ratio,
    }
    mode, q = c["mode"], c["q"]
    if mode == "1d":
        return activation_bytes_1d(**shape, tp=q)
    if mode == "2d":
        return activation_bytes_2d(**shape, q=q)
    if mode == "2.5d":
        return activation_bytes_2p5d(**shape, q=q, depth=c["depth"])
    return activation_bytes_3d(**shape, q=q)


def _saved(rank: int, c: dict[str, Any]) -> tuple[list[int], int]:
    """(bytes saved first inside each block, bytes saved elsewhere) on this rank."""
    mode, cfg = c["mode"], c["cfg"]
    mesh = Mesh(Topology(tp=c["tp"], tp_mode=TPMode(mode), tp_depth=c["depth"]))
    model = parallelize(GPT(cfg, seed=0), plan=gpt_plan(mesh), mesh=mesh)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    region = ["rest"]
    layers: nn.ModuleList = model.layers  # type: ignore[assignment]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: region.__setitem__(0, str(i)))
        layer.register_forward_hook(lambda *_: region.__setitem__(0, "rest"))
    seen: set[int] = set()
    saved: dict[str, list[Tensor]] = {"rest": [], **{str(i): [] for i in range(len(layers))}}

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[region[0]].append(t)
        return t

    idx, targets = make_batch(cfg, c["batch"], seed=1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt_loss(model, idx, targets, mesh)
    blocks = [storage_bytes(saved[str(i)]) for i in range(len(layers))]
    return blocks, storage_bytes(saved["rest"])


@pytest.mark.parametrize("mode", ["1d", "2d", "2.5d", "3d"])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_each_rank_saves_its_modes_formula(mode: str, data: st.DataObject) -> None:
    c = data.draw(case(mode))
    want = formula(c)
    for blocks, rest in run_threaded(c["tp"], _saved, c):
        assert blocks == [want.block] * c["cfg"].n_layers
        assert rest == want.embed_head
        assert sum(blocks) + rest == want.total(c["cfg"].n_layers)


def test_the_formulas_refuse_sizes_the_grid_cannot_split() -> None:
    shape = {"batch": 4, "seq": 8, "hidden": 32, "heads": 4, "vocab": 64}
    with pytest.raises(ValueError, match="heads=3 is not a positive multiple of 2"):
        activation_bytes_1d(**{**shape, "heads": 3}, tp=2)
    with pytest.raises(ValueError, match="batch=3 is not divisible by 2"):
        activation_bytes_2d(**{**shape, "batch": 3}, q=2)
    with pytest.raises(ValueError, match="batch=4 is not divisible by q\\*depth = 2\\*4 = 8"):
        activation_bytes_2p5d(**shape, q=2, depth=4)
    with pytest.raises(ValueError, match="batch=2 is not divisible by 4"):
        activation_bytes_3d(**{**shape, "batch": 2}, q=2)
