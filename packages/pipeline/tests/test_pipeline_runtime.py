"""Tier 2: the pipeline runtime on the gloo worker pool, against the serial reference GPT.

For every registered schedule, p in {2, 4} and its default number of chunks per rank v (its
spec's), a few microbatch counts (fewer than, equal to and more than the ranks where the
schedule's rules allow): each microbatch's loss and every parameter's
gradient equal those of the serial model on the whole batch (`GPT.loss`, one backward) to
fp32 round-off, and so does the whole batch's loss through `forward_loss` (evaluation).
The model has two blocks per virtual stage, partitioned by parameter count. Bound: atol and
rtol 1e-5 (``TOL``): the same fp32 operations, but a microbatch's gradients are summed into
the parameter's in another order than one backward over the whole batch.

Failure: a stage that raises ends the step on every rank with that error (no hang), and the
runtime refuses to step again. The failure tests run last: an aborted step can leave
unmatched p2p messages in the pool's process group, so they restart (close) their pool.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.models import GPT, GPTConfig, make_batch
from tessera.pipeline import (
    SCHEDULES,
    PipelineAborted,
    PipelineRuntime,
    TimedAction,
    build_schedule,
    forward_loss,
    merge_splits,
    partition_by_params,
    stage_modules,
    unsplit,
)
from tessera.pipeline.tune import tuning_steps

MB_SIZE = 2
TOL = {"atol": 1e-5, "rtol": 1e-5}


def config(name: str, p: int) -> GPTConfig:
    """Two blocks per virtual stage: ``2 p v`` blocks in all (embed, layers, head)."""
    v = SCHEDULES[name].chunks()
    return GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=2 * p * v - 2)


def microbatch_counts(name: str, p: int) -> list[int]:
    """Fewer than, equal to and more than ``p``: for each, the largest count the schedule allows
    (e.g. interleaved 1F1B's m % p == 0 turns ``p - 1, p, 2p + 1`` into ``p, 2p``)."""
    spec, counts = SCHEDULES[name], []
    for target in (p - 1, p, 2 * p + 1):
        allowed = [m for m in range(target, 0, -1) if not spec.check(p, m)]
        if allowed and allowed[0] not in counts:
            counts.append(allowed[0])
    return counts


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class Opaque(nn.Module):
    """Hides that a stage is an nn.Sequential (the runtime then cannot cut off its first block)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Any:
        return self.inner(x)


def _build(
    rank: int, name: str, p: int, m: int, cfg: GPTConfig, opaque: bool = False, merge: bool = False
) -> tuple[GPT, PipelineRuntime]:
    model = GPT(cfg, seed=0)
    blocks = model.blocks()
    schedule = build_schedule(name, p, m)
    if merge:  # unit costs: some units stay split, the others run one BW (stage 0's too)
        schedule = merge_splits(schedule)
    part = partition_by_params(blocks, schedule=schedule)
    stages = stage_modules(blocks, part, rank)
    if opaque:
        stages = {s: Opaque(mod) for s, mod in stages.items()}
    return model, PipelineRuntime(schedule, stages, loss_fn)


Result = tuple[tuple[float, ...], float | None, dict[str, Tensor]]


def _run_case(
    rank: int,
    name: str,
    p: int,
    cfg: GPTConfig,
    batches: dict[int, tuple[Tensor, Tensor]],
    opaque: bool,
    merge: bool = False,
) -> dict[int, list[Result]]:
    """Per microbatch count, per step: (losses, mean loss, gradients by parameter name)."""
    out: dict[int, list[Result]] = {}
    for m, (idx, targets) in batches.items():
        model, runtime = _build(rank, name, p, m, cfg, opaque, merge)
        out[m] = []
        for step in range(2):  # a second step on the same runtime, after zeroing the gradients
            model.zero_grad(set_to_none=True)
            result = runtime.step(idx, targets, broadcast_loss=step == 1)
            _check_timeline(runtime, result.timeline)
            grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
            out[m].append((result.losses, result.loss, grads))
        owners = runtime.schedule.stage_to_rank
        evaluated = forward_loss(runtime.stages, owners, idx, targets, loss_fn, group=None, device=idx.device)
        out[m].append(([], evaluated, {}))
    return out


def _check_timeline(runtime: PipelineRuntime, timeline: tuple[TimedAction, ...]) -> None:
    """The timeline shows every unit of this rank once: its F, and one BW (unsplit, or a B
    the runtime fused with its W) or a B and a W."""
    ran: dict[tuple[int, int], list[str]] = defaultdict(list)
    for t in timeline:
        ran[(t.action.microbatch, t.action.stage)].append(t.action.kind.value)
    units = {(a.microbatch, a.stage) for a in runtime.schedule.actions[runtime.rank] if a.is_compute}
    assert set(ran) == units, f"rank {runtime.rank}: timeline units {sorted(ran)}, schedule {sorted(units)}"
    odd = {u: k for u, k in ran.items() if sorted(k) not in (["BW", "F"], ["B", "F", "W"])}
    assert not odd, f"rank {runtime.rank} of {runtime.schedule.name}: units shown as {odd}"


def serial(cfg: GPTConfig, idx: Tensor, targets: Tensor, m: int) -> tuple[list[float], dict[str, Tensor]]:
    """The reference: microbatch losses and the gradients of the whole-batch loss."""
    model = GPT(cfg, seed=0)
    model.loss(idx, targets).backward()
    grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
    with torch.no_grad():
        losses = [model.loss(i, t).item() for i, t in zip(idx.chunk(m), targets.chunk(m), strict=True)]
    return losses, grads


def check_case(
    worker_pools: PoolFactory, p: int, name: str, ms: list[int], opaque: bool, merge: bool = False
) -> None:
    cfg = config(name, p)
    batches = {m: make_batch(cfg, MB_SIZE * m, seed=m) for m in ms}
    per_rank = worker_pools(p).run(_run_case, name, p, cfg, batches, opaque, merge)
    last_rank = SCHEDULES[name].stage_to_rank(p)[-1]
    for m, (idx, targets) in batches.items():
        want_losses, want_grads = serial(cfg, idx, targets, m)
        for step in range(2):
            got: dict[str, Tensor] = {}
            for rank, result in enumerate(per_rank):
                losses, loss, grads = result[m][step]
                assert bool(losses) == (rank == last_rank)
                if losses:
                    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL)
                if losses or step == 1:  # the second step broadcasts the mean loss to every rank
                    assert loss == pytest.approx(sum(want_losses) / m, rel=1e-5)
                else:
                    assert loss is None
                assert not got.keys() & grads.keys(), "a parameter got gradients on two ranks"
                got.update(grads)
            assert got.keys() == want_grads.keys()
            torch.testing.assert_close(got, want_grads, **TOL)  # a dict: the report names the key
        for rank, result in enumerate(per_rank):  # forward_loss: the whole batch, on every rank
            _, evaluated, _ = result[m][2]
            assert evaluated == pytest.approx(sum(want_losses) / m, rel=1e-5), rank


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
def test_runtime_equals_serial(worker_pools: PoolFactory, p: int, name: str) -> None:
    check_case(worker_pools, p, name, microbatch_counts(name, p), opaque=False)


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_runtime_equals_serial_with_opaque_stages(worker_pools: PoolFactory, name: str) -> None:
    """Stage 0 not an nn.Sequential: its B computes nothing and its W the whole backward."""
    check_case(worker_pools, 2, name, [4], opaque=True)


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
@pytest.mark.parametrize("p", [2, 4])
def test_runtime_equals_serial_with_merged_splits(worker_pools: PoolFactory, p: int, name: str) -> None:
    """`merge_splits` schedules mix BW and B/W units, stage 0 included (whose nn.Sequential
    is cut after its first block only where its W really runs apart)."""
    m = 2 * p
    schedule = build_schedule(name, p, m)
    kinds = {a.kind.value for acts in merge_splits(schedule).actions for a in acts}
    assert {"BW", "B", "W"} <= kinds, f"{name} p={p} m={m}: the merge left {kinds}"
    check_case(worker_pools, p, name, [m], opaque=False, merge=True)


def _wrong_stages(rank: int) -> str:
    schedule = build_schedule("1f1b", 2, 2)
    try:
        PipelineRuntime(schedule, {1 - rank: nn.Identity()}, loss_fn)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_runtime_rejects_stages_of_another_rank(worker_pools: PoolFactory) -> None:
    for rank, message in enumerate(worker_pools(2).run(_wrong_stages)):
        assert f"rank {rank} holds stages [{rank}]" in message


class Boom(nn.Module):
    """Runs ``inner``, but raises ValueError("boom") on forward call number ``at`` (from 0)."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: Tensor) -> Any:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise ValueError("boom")
        return self.inner(x)


def _failing_step(rank: int, name: str, p: int, m: int, stage: int, at: int, catch: bool) -> tuple[str, str]:
    cfg = config(name, p)
    _, runtime = _build(rank, name, p, m, cfg)
    if stage in runtime.stages:
        runtime.stages[stage] = Boom(runtime.stages[stage], at)
    idx, targets = make_batch(cfg, MB_SIZE * m, seed=0)
    if not catch:
        runtime.step(idx, targets)
    try:
        runtime.step(idx, targets)
    except Exception as exc:
        first = f"{type(exc).__name__}: {exc}"
    else:
        first = "no error"
    try:
        runtime.step(idx, targets)
    except RuntimeError as exc:
        return first, str(exc)
    return first, "stepped again"


@pytest.mark.parametrize(("name", "p", "stage"), [("zbv", 4, 5), ("1f1b", 4, 2), ("zb-h1", 2, 0)])
def test_a_raising_stage_ends_every_rank(worker_pools: PoolFactory, name: str, p: int, stage: int) -> None:
    pool = worker_pools(p)
    try:
        messages = pool.run(_failing_step, name, p, 4, stage, 2, True)
    finally:
        pool.close()  # the aborted step may have left messages in flight; restart on next use
    owner = SCHEDULES[name].stage_to_rank(p)[stage]
    for rank, (first, again) in enumerate(messages):
        assert "boom" in first, (rank, first)
        if rank == owner:
            assert first == "ValueError: boom"
        else:
            assert first.startswith(PipelineAborted.__name__), (rank, first)
            assert f"rank {owner} raised ValueError in step 1: boom" in first
        assert "was aborted" in again


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fail: bool) -> Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.fail:
            raise ValueError("boom in backward")
        return grad, None


class BoomInLastBackward(nn.Module):
    """Raises in the backward of forward call number ``at`` (from 0)."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: Tensor) -> Any:
        self.calls += 1
        return _RaiseInBackward.apply(self.inner(x), self.calls - 1 == self.at)


def _late_failure(rank: int, m: int) -> tuple[str, str]:
    """Rank 0 fails in its last backward, after rank 1 has finished the step."""
    cfg = config("1f1b", 2)
    _, runtime = _build(rank, "1f1b", 2, m, cfg)
    if rank == 0:
        runtime.stages[0] = BoomInLastBackward(runtime.stages[0], m - 1)
    idx, targets = make_batch(cfg, MB_SIZE * m, seed=0)
    messages = []
    for _ in range(2):
        try:
            runtime.step(idx, targets)
        except Exception as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
        else:
            messages.append("no error")
    return messages[0], messages[1]


def test_a_rank_failing_after_its_peers_finished_the_step(worker_pools: PoolFactory) -> None:
    pool = worker_pools(2)
    try:
        (first0, second0), (first1, second1) = pool.run(_late_failure, 3)
    finally:
        pool.close()
    assert first0 == "ValueError: boom in backward"
    assert "was aborted" in second0
    assert first1 == "no error"  # rank 1 had finished step 1: it learns in step 2
    assert second1.startswith("PipelineAborted: pipeline step 2 aborted: rank 0 raised ValueError in step 1")


def test_the_error_reaches_the_caller_of_the_pool(worker_pools: PoolFactory) -> None:
    with pytest.raises(Exception, match="boom"):
        worker_pools(2).run(_failing_step, "1f1b", 2, 3, 1, 1, False)


def _tuned_steps(rank: int, name: str, p: int, m: int, cfg: GPTConfig, idx: Tensor, targets: Tensor) -> Any:
    model = GPT(cfg, seed=0)
    blocks = model.blocks()
    built = build_schedule(name, p, m)
    stages = stage_modules(blocks, partition_by_params(blocks, schedule=built), rank)
    runtime = PipelineRuntime(built, stages, loss_fn, tune_splits=1)
    steps = []
    for _ in range(tuning_steps(1) + 1):  # as built / unsplit in pairs, the merge, the choice
        model.zero_grad(set_to_none=True)
        result = runtime.step(idx, targets, broadcast_loss=True)
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        ran = {t.action.kind.value for t in result.timeline}
        steps.append((result.loss, grads, ran))
    tuning = runtime.split_tuning
    assert tuning is not None and tuning.costs is not None, "tuning did not finish"
    forms = {"as built": built, "unsplit": unsplit(built), "merged": merge_splits(built, tuning.costs)}
    assert runtime.schedule == forms[tuning.form], f"runs {runtime.schedule}, kept {tuning.form}"
    assert set(tuning.step_seconds) <= set(forms) and tuning.form in tuning.step_seconds
    return steps


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_tuned_splits_train_as_the_serial_model(worker_pools: PoolFactory, name: str) -> None:
    """`tune_splits`: the steps that measure (split, unsplit, merged) and the ones after
    them all equal the serial model; the unsplit steps ran BW only."""
    p, m = 2, 4
    cfg = config(name, p)
    idx, targets = make_batch(cfg, MB_SIZE * m, seed=3)
    per_rank = worker_pools(p).run(_tuned_steps, name, p, m, cfg, idx, targets)
    want_losses, want_grads = serial(cfg, idx, targets, m)
    for step in range(tuning_steps(1) + 1):
        got: dict[str, Tensor] = {}
        for rank_steps in per_rank:
            loss, grads, _ = rank_steps[step]
            assert loss == pytest.approx(sum(want_losses) / m, rel=1e-5), step
            got.update(grads)
        torch.testing.assert_close(got, want_grads, **TOL, msg=lambda s, step=step: f"step {step}: {s}")
    for rank_steps in per_rank:
        assert rank_steps[1][2] <= {"F", "BW"} and rank_steps[3][2] <= {"F", "BW"}, "unsplit steps split"
