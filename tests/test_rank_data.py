"""Each rank reads only its own samples: the main job's batches through ``Engine.local_rows``
and ``Engine.batch_needs`` train exactly what the global batch trains.

On the worker pool, every mode builds the main job's GPT, optimizer and schedule twice from
the same seed: once fed the global batch (every rank builds all ``batch_size`` rows and the
engine keeps its replica's), once fed by ``main_job._rank_batch`` (each rank builds its
replica's rows, and only the inputs or targets its pipeline stages read, with
``local=True``). The losses, gradient norms and validation losses must be equal, bit for
bit (tolerance 0: the same rows reach the same kernels in the same order, so nothing may
differ in the last bit). The tensors each rank builds must be 1/dp of the global batch's
bytes, and nothing on a pipeline's middle stage. The modes: dp=2 with ZeRO-1 on the
built-in corpus (the main job's default), dp=2 x pp=2 and dp=2 x tp=2 on a token file, a
3-stage pipeline (its middle rank reads nothing), ZBV (the first and the last stage on one
rank, the other reads nothing) and dp=2 under ``verify`` (the serial copy gets the global
batch gathered over dp, and must agree with the parallel step); and keyword inputs under
``verify`` at dp=2, with the refusal of a None the rank reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher.config import Config
from tessera.launcher.config.config_io import resolve_config
from tessera.launcher.data.token_data import open_data
from tessera.launcher.job import main_job
from tessera.launcher.job.optim import lr_factor, optimizer_for
from tessera.models import GPT, GPTConfig

STEPS = 3
BASE = [
    "model.seq_len=8",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=4",
    "model.dropout=0.1",  # the dropout masks must come out the same too
    "data.batch_size=8",
    "data.max_chars=20000",
    "optim.warmup_steps=1",
    "train.steps=3",
    "train.eval_batches=1",
    "parallel.microbatches=2",
]
MODES: dict[str, list[str]] = {
    "dp2-zero1-corpus": ["parallel.dp=2", "zero.stage=1"],
    "dp2-pp2": ["parallel.dp=2", "parallel.pp=2", "zero.stage=1", "data.path={bin}"],
    "dp2-tp2": ["parallel.dp=2", "parallel.tp=2", "data.path={bin}"],
    "pp3-middle-reads-nothing": ["parallel.pp=3", "data.path={bin}"],
    "pp2-zbv": ["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "data.path={bin}"],
    "dp2-verify": ["parallel.dp=2", "train.verify=true", "model.dropout=0.0", "train.precision=fp32"],
}


def _train(config: Config, feed: str) -> dict[str, Any]:
    """The main job's model, optimizer and schedule trained ``STEPS`` steps and evaluated once,
    fed the global batch (``feed="global"``) or this rank's part of it (``"local"``)."""
    data = open_data(config)
    m, bs = config.model, config.data.batch_size
    torch.manual_seed(config.train.seed)  # the dropout masks' generator, alike in both runs
    model = GPT(
        GPTConfig(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_layers, m.mlp_ratio, m.dropout, True),
        seed=config.train.seed,
    )
    factor = lr_factor(config)
    engine = main_job.boost(
        model,
        optimizer_for(config, model.parameters()),
        config,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
    )
    built, steps, needs = 0, [], []
    for step in range(STEPS):
        needs.append(engine.batch_needs)
        if feed == "global":
            x, y = data.batch("train", step, bs)
            out = engine.train_step(x, y)
        else:
            x, y = main_job._rank_batch(engine, data, "train", step, bs)
            out = engine.train_step(x, y, local=True)
        built += sum(t.nbytes for t in (x, y) if t is not None)
        steps.append((out.loss, out.grad_norm, out.lr, out.skipped))
    val = main_job._evaluate(engine, data, config, STEPS) if feed == "local" else None
    if feed == "global":
        val = engine.eval_loss(*data.batch("val", STEPS * 1000, bs))
    engine.close()
    return {"steps": steps, "val": val, "bytes_per_step": built / STEPS, "needs": needs}


def _both(rank: int, config: Config) -> dict[str, Any]:
    return {feed: _train(config, feed) for feed in ("global", "local")}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_rank_reads_only_its_rows_and_trains_bit_for_bit_the_same(
    worker_pools: PoolFactory, tmp_path: Path, mode: str
) -> None:
    ids = (np.arange(4000, dtype=np.uint16) * 31) % 61
    ids.tofile(tmp_path / "ids.bin")
    sets = [s.replace("{bin}", str(tmp_path / "ids.bin")) for s in [*BASE, *MODES[mode]]]
    if any(s.startswith("data.path=") for s in sets):
        sets += ["data.token_dtype=uint16", "model.vocab_size=62"]  # 61 ids, even for tp=2
    config = resolve_config(None, sets, env={})
    config, _ = main_job._with_vocab(config, open_data(config).vocab_size, "")  # as the main job does
    results = worker_pools(config.world_size).run(_both, config, timeout=300)
    p = config.parallel
    for rank, r in enumerate(results):
        glob, local = r["global"], r["local"]
        assert local["steps"] == glob["steps"], f"rank {rank}"  # exact: see the module docstring
        assert local["val"] == glob["val"], f"rank {rank}"
        assert all(not skipped for *_, skipped in glob["steps"])
        reads_x, reads_y = local["needs"][-1]
        share = (reads_x + reads_y) / 2 / p.dp  # of the global batch's bytes
        assert local["bytes_per_step"] == glob["bytes_per_step"] * share, f"rank {rank}: {local['needs']}"
    needs = [r["local"]["needs"][-1] for r in results]
    if mode == "pp3-middle-reads-nothing":
        assert needs == [(True, False), (False, False), (False, True)]
    if mode == "pp2-zbv":  # stage 0 and the last stage are both on pipeline rank 0
        assert needs == [(True, True), (False, False)]


def _keyword_curves(rank: int, config: Config) -> dict[str, Any]:
    """The reference GPT fed keyword inputs (``{"idx": ...}``) under ``verify``: the global
    batch, then this replica's rows with ``local=True`` (the verified step's serial copy gets
    the global batch gathered over dp); then the refusal of inputs that are None (every rank
    reads them here, so every rank refuses, before any collective)."""
    data = open_data(config)
    m, bs = config.model, config.data.batch_size
    curves = {}
    for feed in ("global", "local"):
        model = GPT(GPTConfig(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_layers), seed=1)
        engine = main_job.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        curve = []
        for step in range(STEPS):
            if feed == "global":
                x, y = data.batch("train", step, bs)
            else:
                x, y = data.batch("train", step, bs, rows=engine.local_rows(bs))
            out = engine.train_step({"idx": x}, y, local=feed == "local")
            curve.append((out.loss, out.grad_norm))
        curves[feed] = curve
        if feed == "local":
            try:
                engine.eval_loss(None, y, local=True)
            except ValueError as e:
                curves["refused"] = str(e)
        engine.close()
    return curves


def test_keyword_inputs_of_a_rank_train_the_same_under_verify(worker_pools: PoolFactory) -> None:
    sets = [*BASE, "parallel.dp=2", "train.verify=true", "model.dropout=0.0", "train.precision=fp32"]
    config = resolve_config(None, sets, env={})
    config, _ = main_job._with_vocab(config, open_data(config).vocab_size, "")
    for rank, r in enumerate(worker_pools(config.world_size).run(_keyword_curves, config, timeout=300)):
        assert r["local"] == r["global"]  # exact, as above
        assert (
            r["refused"].startswith(f"rank {rank} (pp=1 dp=2")
            and "reads the inputs of the batch; got None" in r["refused"]
        )
