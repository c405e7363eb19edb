"""Activation memory per layer: which layers recompute (``train.recompute_every``), what they
keep (``train.recompute_policy``: whole recompute, or keep the matrix products), and host
offload (``train.activation_offload``).

Each setting trains the reference GPT (4 layers, dropout 0.2) at tp2 on the worker pool and
must give the losses of the run without any of them bit for bit: recomputing replays the same
operations and the same dropout masks, and offload only moves saved tensors. What a layer
keeps for backward is measured on the serial model by counting the bytes autograd saves
outside the checkpointed layers (``saved_tensors_hooks``): none > every 2nd > every layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import BoostConfig, Config, ParallelConfig, TrainConfig, boost
from tessera.launcher.train.recompute import checkpoint_layers
from tessera.models import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=4, bias=False, dropout=0.2)
BATCH = 8


def _config(parallel: ParallelConfig, **train: object) -> Config:
    c = Config(parallel=parallel, train=TrainConfig(precision="fp32", **train))  # type: ignore[arg-type]
    return dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=BATCH),
        model=dataclasses.replace(
            c.model, seq_len=CFG.seq_len, d_model=16, n_heads=4, n_layers=4, dropout=0.2
        ),
    )


def _losses(rank: int, config: Config) -> list[float]:
    torch.manual_seed(7)  # dp's dropout draws from the global stream: the same start for each setting
    model = GPT(CFG, seed=1)
    with boost(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), config) as engine:
        return [engine.train_step(*make_batch(CFG, BATCH, seed=s)).loss for s in range(3)]


TP2, DP2 = ParallelConfig(tp=2), ParallelConfig(dp=2)
SETTINGS = {
    "tp2-every-2nd": (TP2, {"activation_checkpointing": True, "recompute_every": 2}),
    "dp2-save-matmuls": (DP2, {"activation_checkpointing": True, "recompute_policy": "save-matmuls"}),
    "tp2-offload": (TP2, {"activation_offload": True}),
    "tp2-offload-and-recompute": (TP2, {"activation_offload": True, "activation_checkpointing": True}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_setting_trains_exactly_as_without_it(worker_pools: PoolFactory, setting: str) -> None:
    parallel, train = SETTINGS[setting]
    plain = worker_pools(2).run(_losses, _config(parallel), timeout=120)
    got = worker_pools(2).run(_losses, _config(parallel, **train), timeout=120)
    assert got == plain, f"{setting}: {got} != {plain}"


def _saved_bytes(every: int | None) -> int:
    model = GPT(CFG, seed=1)
    model.eval()  # no dropout: the count is of activations only
    if every is not None:
        checkpoint_layers(list(model.layers), every=every)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    ids, targets = make_batch(CFG, BATCH, seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    return total


def test_recomputing_fewer_layers_keeps_more() -> None:
    none, half, every = _saved_bytes(None), _saved_bytes(2), _saved_bytes(1)
    assert none > half > every, (none, half, every)


def test_the_settings_are_checked() -> None:
    every = TrainConfig(recompute_every=0, activation_checkpointing=True)
    assert BoostConfig(train=every).validate() == ["train.recompute_every must be >= 1, got 0"]
    assert BoostConfig(train=TrainConfig(recompute_policy="some")).validate() == [
        "train.recompute_policy='some' is not one of full, save-matmuls",
        "train.recompute_every / recompute_policy need train.activation_checkpointing = true",
    ]
    keep = TrainConfig(activation_checkpointing=True, recompute_policy="save-matmuls")
    assert BoostConfig(parallel=ParallelConfig(tp=2), train=keep).validate() == [
        "train.recompute_policy='save-matmuls' needs parallel.tp = 1 and cp = 1: a collective that reduces "
        "a product in place would change the product it keeps"
    ]
