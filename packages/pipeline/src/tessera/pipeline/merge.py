"""Split a backward only where it pays: `merge_splits` and the costs it needs (`fit_costs`).

A zero-bubble schedule splits every backward into B (input gradient) and W (weight
gradients) so that W's can fill the time a rank would idle. The split is not free: B and W
each walk part of the autograd graph and re-read the output gradient, so on a CPU the two
halves of a small stage cost about 10-15% more than one full backward (measured here on the
reference GPT's stages: B + W 13.5 ms against BW 11.8 ms per microbatch). Where a deferred
W fills no idle time (the rank would be busy anyway, as in a steady state whose stages are
unequal) it only adds that cost.

`merge_splits` turns such units back into one BW at the place of their B, one unit at a time
in microbatch order, keeping a merge when `simulate` under the given `Costs` (``split``: the
extra cost of splitting) does not lengthen the step, and passes over the units left until
none merges (a greedy local search, not an optimum). The result is a valid schedule with the
same name, never slower than the input under those costs; with ``split = 0`` it still merges
every unit whose split changes nothing (a real split always costs something).

`unsplit` merges every unit. `fit_costs` reads the costs off the timelines of steps that ran
(`StepResult.timeline` of every rank; e.g. steps of the schedule and of its `unsplit`, which
has the same stages): the mean F, B, W and BW per stage give ``f``, ``b``, ``w``, the
per-stage ``stage_scale`` and ``split`` (B + W minus BW, where a stage has both; else 0).

The merge takes seconds for large schedules (p = 8, m = 32: about 5 s here): it simulates
the step once per candidate unit and pass.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Set

from tessera.pipeline._build import with_p2p
from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.simulate import Costs, TimedAction, simulate, timed

__all__ = ["fit_costs", "fuse_adjacent", "merge_splits", "unsplit"]

K = ActionKind
_Unit = tuple[int, int]  # (microbatch, stage)


def merge_splits(schedule: Schedule, costs: Costs | None = None) -> Schedule:
    """``schedule`` with every split backward whose split does not shorten the step under
    ``costs`` (default ``Costs()``) run as one BW at the place of its B (module docstring).

    The p2p actions are placed again by the standard lowering (each receive right before the
    compute that needs it, each send right after the compute that produces it)."""
    costs = costs or Costs()
    left = sorted(schedule.split_units())
    merged: set[_Unit] = set()
    best = simulate(schedule, costs).makespan  # validates the schedule and the costs once
    result = schedule
    changed = True
    while changed:  # a merge that lengthened the step may not once others shortened it
        changed = False
        for unit in list(left):
            candidate = _with_merged(schedule, merged | {unit})
            makespan = timed(candidate, costs, rows=False)[0]  # valid: each BW sits where its B was
            if makespan <= best * (1 + 1e-9):
                merged.add(unit)
                left.remove(unit)
                best, result, changed = makespan, candidate, True
    return result


def fuse_adjacent(schedule: Schedule) -> Schedule:
    """``schedule`` with every B whose own W comes next among its rank's computations, with no
    send of its input gradient in between, run as one BW at the B (that W dropped): such a
    split frees no time for anything else and sends nothing earlier, so it only costs. The
    p2p actions stay where they are. What `PipelineRuntime` runs."""
    fused: list[tuple[Action, ...]] = []
    for acts in schedule.actions:
        adjacent: set[_Unit] = set()
        for i, a in enumerate(acts):
            if a.kind is not K.B:
                continue
            unit = (a.microbatch, a.stage)
            for b in acts[i + 1 :]:
                if b.kind is K.SEND_B and (b.microbatch, b.stage) == unit:
                    break
                if b.is_compute:
                    if b.kind is K.W and (b.microbatch, b.stage) == unit:
                        adjacent.add(unit)
                    break
        row = []
        for a in acts:
            if (a.microbatch, a.stage) not in adjacent or a.kind not in (K.B, K.W):
                row.append(a)
            elif a.kind is K.B:
                row.append(Action(K.BW, a.microbatch, a.stage))
        fused.append(tuple(row))
    return dataclasses.replace(schedule, actions=tuple(fused))


def unsplit(schedule: Schedule) -> Schedule:
    """``schedule`` with every split backward run as one BW at the place of its B (e.g. to
    time the unsplit backward of each stage for `fit_costs`)."""
    return _with_merged(schedule, schedule.split_units())


def _with_merged(schedule: Schedule, units: Set[_Unit]) -> Schedule:
    compute = []
    for rank in range(schedule.num_ranks):
        order = []
        for a in schedule.compute_actions(rank):
            unit = (a.microbatch, a.stage)
            if unit in units and a.kind is K.W:
                continue
            order.append(Action(K.BW, *unit) if unit in units and a.kind is K.B else a)
        compute.append(order)
    return with_p2p(schedule.name, schedule.num_microbatches, schedule.stage_to_rank, compute)


def fit_costs(timelines: Iterable[Iterable[TimedAction]], num_stages: int) -> Costs:
    """`Costs` from measured timelines (module docstring): the durations of each kind of
    compute action per stage, averaged; ValueError if a stage has no F or no backward."""
    seconds: dict[tuple[ActionKind, int], list[float]] = defaultdict(list)
    for timeline in timelines:
        for t in timeline:
            if t.action.is_compute:
                seconds[(t.action.kind, t.action.stage)].append(t.end - t.start)
    mean = {key: statistics.fmean(values) for key, values in seconds.items()}
    f_s, b_s, w_s, extra = [], [], [], []  # per stage: F, B, W (a BW alone: half each), B + W - BW
    for s in range(num_stages):
        f, b, w, bw = (mean.get((kind, s)) for kind in (K.F, K.B, K.W, K.BW))
        if b is not None and w is not None:
            if bw is not None:
                extra.append((s, b + w - bw))
        elif bw is not None:
            b = w = bw / 2
        if f is None or b is None or w is None:
            raise ValueError(f"the timelines have no F or no backward (BW, or B and W) of stage {s}")
        f_s.append(f)
        b_s.append(b)
        w_s.append(w)
    totals = [f + b + w for f, b, w in zip(f_s, b_s, w_s, strict=True)]
    unit = math.fsum(totals) / num_stages
    scale = tuple(t / unit for t in totals)
    split = max(0.0, statistics.fmean(e / scale[s] for s, e in extra)) if extra else 0.0
    w_fit = statistics.fmean(w / k for w, k in zip(w_s, scale, strict=True))
    return Costs(
        f=statistics.fmean(f / k for f, k in zip(f_s, scale, strict=True)),
        b=statistics.fmean(b / k for b, k in zip(b_s, scale, strict=True)),
        w=max(w_fit - split, 0.0),  # a measured W includes the split's extra cost
        split=split,
        stage_scale=scale,
    )
