"""``train.compile`` / ``boost(..., compile=True)``: each layer compiled with torch.compile
(CPU inductor here) trains as the same model trained serially and eagerly in plain PyTorch.

A user's model (``tessera.models.foreign.Llamaish``: RMSNorm, rotary positions, SwiGLU,
grouped-query attention) with a plan of roles, 3 steps on the 2-rank worker pool at tp=2,
tp=2 with Megatron SP, pp=2 (1F1B), dp=2 under ZeRO-1, under ZeRO-3 (AdamW) and under
ZeRO-2 with activation checkpointing. Each run starts from a reset dynamo (a mode must
compile its own graphs: each rank counts them, so a run that fell back to eager fails)
and every rank's collectives run eagerly between the compiled pieces
(``tessera.launcher.train.compiling``).

Bounds, as ``test_every_mode`` (compiled kernels fuse and reorder float sums, within fp32
round-off): losses rel 1e-5; weights under SGD with momentum rtol 1e-5, atol 1e-6 (measured
at most 1.2e-7, the same as the eager parallel runs); under AdamW atol 1e-4 (its update
divides by the root of the second moment and so amplifies round-off in near-zero gradients;
a wrong gradient moves a weight by about lr = 1e-2). A schedule that splits the backward
(zbv) is refused before anything is built. The main job resolves ``--set
train.compile=true`` and trains compiled (in this process, world 1, the launcher's checks
first) with the losses of its eager run, rel 1e-5, dropout on (a compiled layer draws its
masks with torch's kernels, as eagerly: inductor's own generator would draw others).
Checkpointing wraps the compiled layers and keeps, compiled, exactly the bytes it keeps
eagerly (counted by saved-tensor hooks). The reference GPT with dropout at tp=2 with
Megatron SP, with and without checkpointing, trains compiled with the losses of its eager
run, rel 1e-5 (the tensor-parallel dropout streams and the checkpoint's replay draw the same
masks: measured equal here; other masks move the losses by about 2e-3 relative).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import BoostConfig, Config, ParallelConfig, boost
from tessera.launcher.config.config_io import RESOLVED_ENV, RUN_FOLDER_ENV, config_to_dict, resolve_config
from tessera.launcher.job import main_job
from tessera.launcher.run.preflight import preflight
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    assert_matches_serial,
    boosted_run,
    oracle_config,
    serial_run,
)
from tessera.models import GPT, LLAMAISH_ROLES, ForeignConfig, GPTConfig, Llamaish, make_batch

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 3
SIZES = ForeignConfig(vocab=VOCAB, dim=64, heads=4, kv_heads=2, layers=2, hidden=96)
ROLES = LLAMAISH_ROLES
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


def _optimizer(model: nn.Module, adamw: bool) -> torch.optim.Optimizer:
    if adamw:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _compiled(rank: int, config: Config, adamw: bool, argument: bool) -> tuple[Run, int]:
    """Train compiled (``argument``: by ``boost(compile=True)``, else by ``train.compile``)
    and count the graphs this rank compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compile = True if argument else None
    run = boosted_run(
        Llamaish(SIZES, seed=0),
        TOKENS.first(STEPS),
        config,
        lambda m: _optimizer(m, adamw),
        plan=ROLES,
        compile=compile,
    )
    graphs = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return run, graphs


P = ParallelConfig
MODES: dict[str, tuple[ParallelConfig, dict[str, Any]]] = {
    "tp2": (P(tp=2), {"argument": True}),
    "tp2-megatron-sp": (P(tp=2, sequence_parallel=True), {}),
    "pp2-1f1b": (P(pp=2, microbatches=2, schedule="1f1b"), {}),
    "dp2-zero1": (P(dp=2), {"stage": 1}),
    "dp2-zero3-adamw": (P(dp=2), {"stage": 3, "adamw": True}),
    "dp2-zero2-checkpointing": (P(dp=2), {"stage": 2, "checkpointing": True}),
}


def _config(parallel: ParallelConfig, stage: int, *, compile: bool, checkpointing: bool = False) -> Config:
    return oracle_config(
        parallel, stage, batch_size=BATCH, compile=compile, activation_checkpointing=checkpointing
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_a_compiled_model_follows_its_eager_serial_run(worker_pools: PoolFactory, mode: str) -> None:
    parallel, extra = MODES[mode]
    adamw, argument = bool(extra.get("adamw")), bool(extra.get("argument"))
    config = _config(
        parallel,
        int(extra.get("stage", 0)),
        compile=not argument,  # the argument stands for train.compile
        checkpointing=bool(extra.get("checkpointing")),
    )
    assert BoostConfig.validate(config) == []
    results = worker_pools(config.world_size).run(_compiled, config, adamw, argument, timeout=300)
    for rank, (_, graphs) in enumerate(results):
        assert graphs > 0, f"rank {rank} compiled no graph: it trained eagerly"
    serial = serial_run(Llamaish(SIZES, seed=0), TOKENS.first(STEPS), lambda m: _optimizer(m, adamw))
    rtol, atol = (1e-4, 1e-4) if adamw else (1e-5, 1e-6)  # the bounds of the module docstring
    assert_matches_serial([run for run, _ in results], serial, rtol=rtol, atol=atol)


def test_a_schedule_that_splits_the_backward_is_refused_compiled() -> None:
    zbv = P(pp=2, microbatches=2, schedule="zbv", virtual_stages=2)
    config = _config(zbv, 0, compile=True)
    (line,) = BoostConfig.validate(config)
    assert "train.compile=true with parallel.schedule='zbv' is not built" in line
    assert "splits the backward" in line
    assert BoostConfig.validate(_config(zbv, 0, compile=False)) == []
    # boost(compile=True) is validated as train.compile: refused before any process group is used
    model = Llamaish(SIZES, seed=0)
    with pytest.raises(ValueError, match=r"parallel\.schedule='zbv' is not built"):
        boost(model, _optimizer(model, False), _config(zbv, 0, compile=False), compile=True)


MAIN_JOB = [
    "parallel.dp=1",
    "parallel.microbatches=1",
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_layers=2",
    "model.dropout=0.1",  # compiled layers draw eager's masks
    "data.batch_size=4",
    "data.max_chars=20000",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=4",
    "train.eval_batches=1",
    "train.sample_chars=8",
]


def _main_job_here(sets: list[str], run: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], int]:
    """``tessera train --set ...`` resolved and checked as the launcher does, then the main job
    in this process (world 1): its logged losses and the graphs dynamo compiled."""
    from torch._dynamo.utils import counters

    config = resolve_config(None, [*MAIN_JOB, f"train.run_dir={run.parent}", f"train.name={run.name}", *sets])
    assert preflight(config, main_job=True) == []
    resolved = run.parent / f"{run.name}.json"
    resolved.write_text(json.dumps(config_to_dict(config)))
    run.mkdir(parents=True)
    monkeypatch.setenv(RESOLVED_ENV, str(resolved))
    monkeypatch.setenv(RUN_FOLDER_ENV, str(run))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)  # the dropout masks' generator, as a fresh process's default is fixed
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(run.parent / f"{run.name}.store"), 1), rank=0, world_size=1
    )
    try:
        main_job.main()  # destroys the process group at its end
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    graphs = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [float(r["loss"]) for r in records if "loss" in r], graphs


def test_the_main_job_trains_compiled_as_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled, graphs = _main_job_here(["train.compile=true"], tmp_path / "compiled", monkeypatch)
    eager, none = _main_job_here([], tmp_path / "eager", monkeypatch)
    assert graphs > 0 and none == 0
    assert len(compiled) == 4
    assert compiled == pytest.approx(eager, rel=1e-5)


def _saved_bytes(checkpointing: bool, compile: bool) -> int:
    """The bytes autograd keeps for backward in one forward of the boosted model (world 1),
    after a first forward and backward (the compile)."""
    model = Llamaish(SIZES, seed=0)
    config = _config(P(microbatches=1), 0, compile=compile, checkpointing=checkpointing)
    engine = boost(model, _optimizer(model, False), config, plan=ROLES)
    ids = TOKENS.at(0)[0]
    engine.module(ids).sum().backward()
    kept = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = engine.module(ids)
    out.sum().backward()
    engine.mesh.close()
    return kept


def test_checkpointing_keeps_only_the_layer_inputs_when_compiled(tmp_path: Path) -> None:
    """The checkpoint wraps the compiled forward: what the compiled layers keep for backward
    goes through its saved-tensor hooks, so it keeps what it keeps eagerly (each layer's input)."""
    torch._dynamo.reset()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        kept = {(ac, c): _saved_bytes(ac, c) for ac, c in ((True, False), (True, True), (False, True))}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert kept[True, True] == kept[True, False], kept
    assert kept[True, True] < kept[False, True] / 2, kept


DROPOUT_GPT = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, dropout=0.1)


def _dropout_run(rank: int, compiled: bool, checkpointing: bool) -> tuple[list[float], int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)  # the default generator the replicated dropout stream starts from
    model = GPT(DROPOUT_GPT, seed=0)
    parallel = P(tp=2, microbatches=1, sequence_parallel=True)
    config = _config(parallel, 0, compile=compiled, checkpointing=checkpointing)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    try:
        losses = [engine.train_step(*make_batch(DROPOUT_GPT, 4, seed=i)).loss for i in range(3)]
    finally:
        engine.mesh.close()
    graphs = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return losses, graphs


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_dropout_masks_are_the_eager_ones_compiled(worker_pools: PoolFactory, checkpointing: bool) -> None:
    pool = worker_pools(2)
    eager = pool.run(_dropout_run, False, checkpointing, timeout=300)
    compiled = pool.run(_dropout_run, True, checkpointing, timeout=300)
    for (want, _), (got, graphs) in zip(eager, compiled, strict=True):
        assert graphs > 0
        assert got == pytest.approx(want, rel=1e-5)
