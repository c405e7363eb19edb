"""Integration: boost() composing dp x pp x tp x ZeRO equals the serial GPT, step by step.

Every rank gets the same global batch; the serial model trains on it with the same
optimizer, clipping and data. Each composition runs a few steps on the worker pool and is
compared with the serial run on three things, each with its own bound:

- losses, rel 1e-5: a mean over 256 token losses in fp32 summed in another order (tp splits
  the vocabulary and the heads, dp and microbatches split the batch) moves by a few ulps;
- global gradient norms before clipping, rel 1e-4: a square root of a sum over every
  parameter of squares computed per shard, hence a few more roundings;
- the trained weights, consolidated from every rank's shards (`Engine.full_state_dict`).
  Under SGD with momentum the update is linear in the gradient, so weights stay at
  round-off: elementwise atol 1e-6 + rtol 1e-5.
  AdamW steps an element by about lr whatever its gradient's size, so round-off in a small
  gradient can move that element by up to twice Adam's largest step, on any machine; its
  bound is derived from the optimizer (`tessera.comm.testing.assert_adam_close`): every
  element within that envelope, and per tensor a mean distance of at most 1/1000 of the
  farthest a run can travel. A wrong shard or a lost contribution moves many elements.

Measured here: serial against serial with the batch accumulated in two microbatches (another
summation order; ``test_the_weight_bounds_hold_serial_against_serial`` re-checks it) at most
5.3e-6 elementwise under AdamW and 7.5e-9 under SGD; dp2 x tp2 (+SP) with ZeRO-1 against
serial at most 4.2e-5 under AdamW (median per tensor 1e-7 to 5e-7; the mean bound is 4e-5)
and 7.5e-9 under SGD.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tessera.comm.testing import assert_adam_close
from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.models import GPT, GPTConfig, make_batch

GPT_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
STEPS = 4
BATCH = 8
LR = {"adamw": 1e-2, "sgd": 0.5, "sgd-groups": 0.5}
CLIP = 0.05
BETAS = (0.9, 0.95)


def _config(parallel: ParallelConfig, zero: int, optim: str = "adamw") -> Config:
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision="fp32"))
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, batch_size=BATCH))
    return dataclasses.replace(
        c,
        model=dataclasses.replace(c.model, seq_len=GPT_CFG.seq_len, d_model=16, n_heads=4, n_layers=2),
        optim=dataclasses.replace(
            c.optim, name=optim.split("-")[0], lr=LR[optim], clip_grad_norm=CLIP, weight_decay=0.1
        ),
    )


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd-groups":  # the usual practice: no weight decay, another lr for norms
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0, "lr": 0.2}]
        return torch.optim.SGD(groups, lr=LR[kind], momentum=0.9, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[kind], momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=LR[kind], betas=BETAS, weight_decay=0.1)


Run = tuple[list[tuple[float, float]], dict[str, torch.Tensor]]


def _serial(kind: str, microbatches: int = 1, steps: int = STEPS) -> Run:
    """The reference: one process, the whole batch (in ``microbatches`` accumulated parts)."""
    model = GPT(GPT_CFG, seed=1)
    opt = _optimizer(model, kind)
    out = []
    for step in range(steps):
        idx, targets = make_batch(GPT_CFG, BATCH, seed=step)
        opt.zero_grad()
        loss_sum = 0.0
        for xb, yb in zip(idx.chunk(microbatches), targets.chunk(microbatches), strict=True):
            loss = model.loss(xb, yb) / microbatches
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        out.append((loss_sum, float(norm)))
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parallel(rank: int, config: Config, kind: str, steps: int = STEPS) -> Run:
    model = GPT(GPT_CFG, seed=1)
    engine = boost(model, _optimizer(model, kind), config)
    out = []
    for step in range(steps):
        idx, targets = make_batch(GPT_CFG, BATCH, seed=step)
        result = engine.train_step(idx, targets)
        assert result.grad_norm is not None
        out.append((result.loss, result.grad_norm))
    weights = engine.full_state_dict()
    engine.mesh.close()
    return out, weights


def check_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], kind: str) -> None:
    """The bound for ``kind`` from the module docstring."""
    if kind.startswith("sgd"):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert_adam_close(got, want, lr=LR[kind], steps=STEPS, betas=BETAS)


def _check(results: list[Run], serial: Run, kind: str) -> None:
    """Losses and global gradient norms (before clipping) on every rank, then the weights
    merged over the pipeline ranks, against the serial run."""
    for curve, _ in results:
        assert [loss for loss, _ in curve] == pytest.approx([loss for loss, _ in serial[0]], rel=1e-5)
        assert [norm for _, norm in curve] == pytest.approx([norm for _, norm in serial[0]], rel=1e-4)
    merged: dict[str, torch.Tensor] = {}
    for _, weights in results:
        merged.update(weights)
    check_weights(merged, serial[1], kind)


CASES = [
    (ParallelConfig(dp=2, tp=2, microbatches=2), 0, "sgd"),
    (ParallelConfig(dp=2, tp=2, sequence_parallel=True, microbatches=2), 1, "adamw"),
    (ParallelConfig(dp=2, tp=2, microbatches=2), 2, "sgd"),
    (ParallelConfig(dp=2, tp=2, microbatches=1), 3, "adamw"),
    (ParallelConfig(dp=4, microbatches=1), 3, "sgd"),
    (ParallelConfig(pp=2, tp=2, microbatches=4, schedule="1f1b"), 0, "adamw"),
    (ParallelConfig(dp=2, pp=2, microbatches=2, schedule="zb-h1"), 1, "sgd"),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True, microbatches=2, schedule="1f1b"), 1, "sgd"),
    (ParallelConfig(pp=2, tp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2), 1, "adamw"),
    (ParallelConfig(pp=2, dp=2, microbatches=2, schedule="zbv", virtual_stages=2), 0, "sgd"),
    (ParallelConfig(pp=2, tp=2, microbatches=2, schedule="1f1b"), 1, "sgd-groups"),
    # ZeRO-2/3 with pipelining (one reduction per step; stage 3 gathers a stage once per step)
    (ParallelConfig(dp=2, pp=2, microbatches=2, schedule="1f1b"), 2, "sgd"),
    (ParallelConfig(dp=2, pp=2, microbatches=2, schedule="zb-h1"), 3, "adamw"),
    (ParallelConfig(dp=2, pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2), 3, "sgd"),
    # ZeRO-2/3 with Megatron sequence parallelism (norm gradients summed over tp first)
    (ParallelConfig(dp=2, tp=2, sequence_parallel=True, microbatches=2), 3, "sgd"),
    (ParallelConfig(dp=2, tp=2, sequence_parallel=True, microbatches=2), 2, "adamw"),
    # context parallelism: ring (zigzag) and Ulysses, with dp, tp, pp and ZeRO over dp x cp
    (ParallelConfig(cp=2, cp_layout="zigzag", microbatches=1), 0, "sgd"),
    (ParallelConfig(dp=2, cp=2, cp_mode="ulysses", microbatches=2), 1, "sgd"),
    (ParallelConfig(tp=2, cp=2, cp_layout="zigzag", microbatches=2), 3, "sgd"),
    (ParallelConfig(pp=2, cp=2, microbatches=2, schedule="1f1b"), 1, "adamw"),
    (ParallelConfig(tp=2, sequence_parallel=True, cp=2, microbatches=2), 1, "sgd"),
    # 2D tensor parallelism (q = 2), alone, with dp and with pp
    (ParallelConfig(tp=4, tp_mode="2d", microbatches=2), 0, "sgd"),
    (ParallelConfig(dp=2, tp=4, tp_mode="2d", microbatches=1), 1, "sgd"),
    (ParallelConfig(pp=2, tp=4, tp_mode="2d", microbatches=2, schedule="1f1b"), 1, "adamw"),
    # 2.5D (q = 2, depth 2) and 3D (q = 2): 8 ranks each
    (ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2, microbatches=2), 1, "sgd"),
    (ParallelConfig(tp=8, tp_mode="3d", microbatches=2), 0, "sgd"),
]


def _case_id(c: Any) -> str:
    if isinstance(c, ParallelConfig):
        megatron_sp = "-msp" if c.sequence_parallel else ""
        mode = f"-{c.tp_mode}" + (f"x{c.tp_depth}" if c.tp_depth > 1 else "") if c.tp_mode != "1d" else ""
        context = f"-cp{c.cp}-{c.cp_mode}-{c.cp_layout}" if c.cp > 1 else ""
        return f"dp{c.dp}-pp{c.pp}-tp{c.tp}{mode}{megatron_sp}{context}-{c.schedule}"
    return f"zero{c}" if isinstance(c, int) else str(c)


@pytest.mark.parametrize(("parallel", "zero", "kind"), CASES, ids=_case_id)
def test_composition_follows_the_serial_run(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int, kind: str
) -> None:
    config = _config(parallel, zero, kind)
    assert config.validate() == []
    results = worker_pools(config.world_size).run(_parallel, config, kind, timeout=120)
    _check(results, _serial(kind), kind)


def test_dp_pp_tp_with_zero_on_eight_ranks(worker_pools: PoolFactory) -> None:
    config = _config(ParallelConfig(dp=2, pp=2, tp=2, microbatches=2, schedule="1f1b"), 1, "sgd")
    results = worker_pools(8).run(_parallel, config, "sgd", timeout=180)
    _check(results, _serial("sgd"), "sgd")


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(cp=2, cp_layout="zigzag", microbatches=1),
        ParallelConfig(cp=4, cp_mode="ulysses", microbatches=1),
        ParallelConfig(dp=2, cp=2, microbatches=1),
        ParallelConfig(tp=2, cp=2, cp_layout="zigzag", microbatches=1),
        ParallelConfig(pp=2, cp=2, microbatches=2, schedule="1f1b"),
    ],
    ids=["cp2-ring-zigzag", "cp4-ulysses", "dp2-sp2-ring", "tp2-sp2-ring-zigzag", "pp2-sp2-ring"],
)
def test_context_parallelism_follows_twenty_serial_steps(
    worker_pools: PoolFactory, parallel: ParallelConfig
) -> None:
    """20 SGD steps with ZeRO-1: every loss, gradient norm and the final weights against
    serial (the same bounds as above; SGD keeps the weights at round-off over 20 steps)."""
    config = _config(parallel, 1, "sgd")
    results = worker_pools(config.world_size).run(_parallel, config, "sgd", 20, timeout=180)
    _check(results, _serial("sgd", steps=20), "sgd")


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(tp=4, tp_mode="2d", microbatches=1),
        ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2, microbatches=1),
        ParallelConfig(tp=8, tp_mode="3d", microbatches=1),
    ],
    ids=["2d-q2", "2.5d-q2-d2", "3d-q2"],
)
def test_multi_dimensional_tp_follows_twenty_serial_steps(
    worker_pools: PoolFactory, parallel: ParallelConfig
) -> None:
    """20 SGD steps with ZeRO-1 per tensor-parallel mode: losses, gradient norms and the final
    weights against serial (the bounds of the module docstring)."""
    config = _config(parallel, 1, "sgd")
    results = worker_pools(config.world_size).run(_parallel, config, "sgd", 20, timeout=180)
    _check(results, _serial("sgd", steps=20), "sgd")


@pytest.mark.parametrize(
    ("parallel", "zero"),
    [
        (ParallelConfig(pp=2, microbatches=4, schedule="zb-h1", tune_splits=1), 1),
        (ParallelConfig(pp=2, microbatches=4, schedule="zbv", virtual_stages=2, tune_splits=1), 1),
        (ParallelConfig(pp=2, tp=2, microbatches=4, schedule="zb-h1", tune_splits=1), 1),
        (ParallelConfig(dp=2, pp=2, microbatches=2, schedule="zb-h1", tune_splits=1), 3),
    ],
    ids=["zb-h1", "zbv", "tp2-zb-h1", "dp2-zb-h1-zero3"],
)
def test_zero_bubble_tuning_follows_the_serial_run(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int
) -> None:
    """``tune_splits=1``: as built and unsplit in pairs, the merge against the better, then
    the faster (`tuning_steps(1)` = 7 steps at most); 8 SGD steps against serial (the bounds
    of the module docstring). With tp=2 the two pipelines (one per tensor-parallel rank)
    must pick the same form: their stages' collectives meet."""
    config = _config(parallel, zero, "sgd")
    results = worker_pools(config.world_size).run(_parallel, config, "sgd", 8, timeout=180)
    _check(results, _serial("sgd", steps=8), "sgd")


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_weight_bounds_hold_serial_against_serial(kind: str) -> None:
    """The bounds above accept the serial run summed in another order (two microbatches)."""
    whole, parts = _serial(kind), _serial(kind, microbatches=2)
    check_weights(parts[1], whole[1], kind)
    assert [loss for loss, _ in parts[0]] == pytest.approx([loss for loss, _ in whole[0]], rel=1e-5)


def _resume(rank: int, config: Config, path: str) -> tuple[list[float], list[float]]:
    """Five steps straight, and two steps + save + a new engine that loads and runs three more."""

    def fresh() -> Any:
        return _fresh(config, seed=1)

    straight = fresh()
    a = [straight.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(5)]
    first = fresh()
    b = [first.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(2)]
    first.save(path)
    second = fresh()
    second.load(path)
    assert second.step == 2
    b += [second.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(second.step, 5)]
    return a, b


@pytest.mark.parametrize(
    ("parallel", "zero"),
    [
        (ParallelConfig(dp=2, tp=2, microbatches=2), 1),
        (ParallelConfig(pp=2, tp=2, microbatches=2), 0),
        (ParallelConfig(dp=4, microbatches=2), 3),
    ],
    ids=["dp2-tp2-zero1", "pp2-tp2", "dp4-zero3"],
)
def test_resume_continues_the_exact_loss_curve(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig, zero: int
) -> None:
    config = _config(parallel, zero)
    for straight, resumed in worker_pools(4).run(_resume, config, str(tmp_path / "ckpt"), timeout=180):
        assert resumed == straight  # bit for bit


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_pipeline_and_plain_dp_follow_one_rank(
    worker_pools: PoolFactory, precision: str
) -> None:
    """fp16 / bf16 through a pipeline (pp2, 1F1B, ZeRO-1; fp16 scales the loss through every
    stage's backward) and through plain data parallelism (dp2, stage 0) against one rank with
    the same precision, microbatches and SGD. Bounds: losses rel 5e-3 and gradient norms rel
    2e-2: both runs round to the same 8 (bf16) or 11 (fp16) significand bits, in another
    order. The norms are reported unscaled: a stage whose backward missed the loss scale
would report a norm 2^16 times too small (and step 2^16 times too little)."""

    def run(parallel: ParallelConfig, zero: int) -> list[Run]:
        c = _config(parallel, zero, "sgd")
        c = dataclasses.replace(c, train=dataclasses.replace(c.train, precision=precision))
        assert c.validate() == []
        return worker_pools(c.world_size).run(_parallel, c, "sgd", timeout=180)

    (alone,) = run(ParallelConfig(microbatches=2), 0)
    pipeline, plain = ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), ParallelConfig(dp=2)
    for parallel, zero in ((pipeline, 1), (plain, 0)):
        for curve, _ in run(parallel, zero):
            assert [loss for loss, _ in curve] == pytest.approx([loss for loss, _ in alone[0]], rel=5e-3)
            assert [norm for _, norm in curve] == pytest.approx([norm for _, norm in alone[0]], rel=2e-2)


def _train_and_save(rank: int, config: Config, path: str) -> list[float]:
    """Five steps of the reference run, saving after the second."""
    engine = _fresh(config)
    losses = []
    for step in range(5):
        losses.append(engine.train_step(*make_batch(GPT_CFG, BATCH, seed=step)).loss)
        if step == 1:
            engine.save(path)
    engine.mesh.close()
    return losses


def _fresh(config: Config, seed: int = 7) -> Any:
    """A boosted reference GPT with a decaying learning-rate schedule."""
    model = GPT(GPT_CFG, seed=seed)
    opt = _optimizer(model, config.optim.name)
    return boost(
        model,
        opt,
        config,
        scheduler_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    )


def _load_and_continue(rank: int, config: Config, path: str) -> list[float]:
    engine = _fresh(config)
    engine.load(path)
    assert engine.step == 2
    losses = [engine.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(2, 5)]
    engine.mesh.close()
    return losses


def test_a_checkpoint_reshards_to_other_degrees_modes_and_stages(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """Saved by dp2 x pp2 x tp2 with ZeRO-1 (AdamW, a learning-rate schedule), loaded by dp4 x
    tp2 with ZeRO-3, by 2D tensor parallelism (q = 2) x dp2 with ZeRO-2, and by one rank: the
    next three losses equal the uninterrupted run's. Bound rel 1e-5: the moments and masters
    are carried exactly (fp32 by name), the runs then sum in other orders (a few ulps per
    step); a lost moment or a wrong shard moves the loss at the first step after loading."""
    path = str(tmp_path / "ckpt")
    saver = _config(ParallelConfig(dp=2, pp=2, tp=2, microbatches=2, schedule="1f1b"), 1)
    straight = worker_pools(8).run(_train_and_save, saver, path, timeout=180)[0]
    targets = [
        _config(ParallelConfig(dp=4, tp=2, microbatches=2), 3),
        _config(ParallelConfig(dp=2, tp=4, tp_mode="2d", microbatches=1), 2),
        _config(ParallelConfig(microbatches=2), 0),
    ]
    for config in targets:
        for resumed in worker_pools(config.world_size).run(_load_and_continue, config, path, timeout=180):
            assert resumed == pytest.approx(straight[2:], rel=1e-5)


def _with_checkpointing(config: Config, on: bool) -> Config:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, activation_checkpointing=on))


@pytest.mark.parametrize(
    ("parallel", "zero"),
    [
        (ParallelConfig(dp=2, tp=2, sequence_parallel=True, microbatches=2), 3),
        (ParallelConfig(pp=2, tp=2, microbatches=2, schedule="zb-h1"), 1),
    ],
    ids=["dp2-tp2-msp-zero3", "pp2-tp2-zbh1"],
)
def test_activation_checkpointing_follows_the_serial_run(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int
) -> None:
    """Every layer recomputed in backward: the same bounds against serial as without it."""
    config = _with_checkpointing(_config(parallel, zero, "sgd"), True)
    results = worker_pools(config.world_size).run(_parallel, config, "sgd", timeout=120)
    _check(results, _serial("sgd"), "sgd")


def _dropout_run(rank: int, config: Config) -> list[float]:
    model = GPT(dataclasses.replace(GPT_CFG, dropout=0.2), seed=1)
    engine = boost(model, _optimizer(model, "sgd"), config)
    losses = [engine.train_step(*make_batch(GPT_CFG, BATCH, seed=s)).loss for s in range(3)]
    engine.mesh.close()
    return losses


def test_activation_checkpointing_replays_the_dropout_masks(worker_pools: PoolFactory) -> None:
    """With dropout 0.2 under tp2 (the parallel dropout streams) and dp2: recomputing each
    layer draws the masks of its first forward, so the losses equal those without
    checkpointing bit for bit (the same operations in the same order)."""
    base = _config(ParallelConfig(dp=2, tp=2, microbatches=2), 1, "sgd")
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, dropout=0.2))
    plain = worker_pools(4).run(_dropout_run, _with_checkpointing(base, False), timeout=120)
    recomputed = worker_pools(4).run(_dropout_run, _with_checkpointing(base, True), timeout=120)
    assert recomputed == plain


# ---------------------------------------------------------------------------- any composition
# Hypothesis draws dp, pp, tp (1D, with or without Megatron SP), cp (ring or Ulysses), the
# ZeRO stage, the pipeline schedule and the precision; whatever the config accepts trains
# four SGD steps on the worker pool. fp32 cases are held to this module's bounds against the
# serial GPT. bf16 cases are held against one rank in bf16 with the same microbatches: losses
# rel 5e-3 and norms rel 2e-2 (both round to 8 significand bits, in another order); their
# weights are not compared, as a bf16 step's round-off is of the size of the update.
SCHEDULES = {"1f1b": 1, "gpipe": 1, "zb-h1": 1, "interleaved-1f1b": 2}


@st.composite
def compositions(draw: st.DrawFn) -> Config:
    dp, pp, tp, cp = (draw(st.sampled_from([1, 2])) for _ in range(4))
    assume(dp * pp * tp * cp <= 8)
    schedule = draw(st.sampled_from(sorted(SCHEDULES))) if pp > 1 else "1f1b"
    parallel = ParallelConfig(
        dp=dp,
        pp=pp,
        tp=tp,
        cp=cp,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        cp_mode=draw(st.sampled_from(["ring", "ulysses"])),
        schedule=schedule,
        virtual_stages=SCHEDULES[schedule] if pp > 1 else 1,
        microbatches=draw(st.sampled_from([1, 2, 4])),
    )
    config = _config(parallel, draw(st.integers(0, 3)), "sgd")
    precision = draw(st.sampled_from(["fp32", "fp32", "bf16"]))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision))
    assume(config.validate() == [])
    return config


def _alone(config: Config) -> Config:
    """One rank, the same precision and microbatches: the bf16 reference."""
    return dataclasses.replace(config, parallel=ParallelConfig(microbatches=config.parallel.microbatches))


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=compositions())
def test_any_accepted_composition_follows_the_serial_run(worker_pools: PoolFactory, config: Config) -> None:
    results: list[Run] = worker_pools(config.world_size).run(_parallel, config, "sgd", timeout=180)
    if config.train.precision == "fp32":
        _check(results, _serial("sgd"), "sgd")
        return
    (alone,) = worker_pools(1).run(_parallel, _alone(config), "sgd", timeout=180)
    for curve, _ in results:
        assert [loss for loss, _ in curve] == pytest.approx([loss for loss, _ in alone[0]], rel=5e-3)
        assert [norm for _, norm in curve] == pytest.approx([norm for _, norm in alone[0]], rel=2e-2)


def _held(rank: int, config: Config) -> tuple[int, int]:
    model = GPT(GPT_CFG, seed=1)
    engine = boost(model, _optimizer(model, "sgd"), config)
    held = sum(p.numel() for p in model.parameters())
    local = sum(p.numel() for p in engine.module.parameters())
    engine.mesh.close()
    return held, local


def test_a_pipeline_rank_releases_the_other_stages_weights(worker_pools: PoolFactory) -> None:
    """After boost() under pp2 the caller's model holds only this rank's stages' elements
    (the rest are emptied), so a rank does not keep the whole serial model resident."""
    config = _config(ParallelConfig(pp=2, microbatches=2), 0, "sgd")
    results = worker_pools(2).run(_held, config, timeout=120)
    total = sum(p.numel() for p in GPT(GPT_CFG, seed=1).parameters())
    assert sum(local for _, local in results) == total
    for held, local in results:
        assert held == local < total
