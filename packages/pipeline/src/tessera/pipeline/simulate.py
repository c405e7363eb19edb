"""Time a schedule under simple costs: makespan, bubble, peak activations, per-action times.

The timing model (the same p2p model `validate` proves progress under):

- each rank runs its actions in list order, one at a time, from time 0;
- F costs ``f``, B costs ``b``, W costs ``w + split``, BW (unsplit backward) costs ``b + w``;
- a send costs its rank nothing and never waits; the tensor is available to the receiver
  ``p2p_latency`` after the send was issued;
- a receive waits until its tensor is available; the waiting is idle time.

Bubble of rank ``r`` is ``(makespan - busy_r) / makespan`` where ``busy_r`` is the rank's
compute time and ``makespan`` the end of the last action on any rank. The fraction does not
depend on the time unit, so only the ratios between ``f``, ``b``, ``w`` and the latency matter.

`replay` runs the same model with the compute times one measured step took on each action
and no message latency: the critical path of that step, a lower bound for any runtime of
the schedule with those computations (what a measured step lost to messages, waits and
the runtime's own work is its time minus this).

Activations are counted in (microbatch, stage) units, i.e. per chunk for multi-chunk
schedules, by walking each rank's list in order (memory only changes at that rank's own
actions, so timing does not matter):

- ``peak_in_flight[r]``: the most units whose F has run and whose backward for the input (B,
  or BW when unsplit) has not. This is the usual 1F1B count: ``min(p - r, m)`` for 1F1B,
  ``m`` for GPipe.
- ``peak_held[r]``: the most units whose F has run and whose W (or BW) has not: a split
  backward keeps the inputs of the weight gradient until W. Equal to ``peak_in_flight`` for
  unsplit schedules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.validate import validate

__all__ = ["Costs", "SimResult", "TimedAction", "activation_peaks", "replay", "simulate", "timed"]

K = ActionKind


@dataclass(frozen=True, slots=True)
class Costs:
    """Durations of one action on one (microbatch, stage) unit, and the p2p latency.

    ``stage_scale``: per-stage multipliers of ``f``, ``b`` and ``w`` (stages of unequal
    work, e.g. a pipeline's embedding and head stages); empty: every stage costs the same.
    ``split``: what a backward split into B and W costs beyond one unsplit BW, charged to
    the W (the two halves re-read the output gradient, on a CPU from memory rather than
    cache, and B keeps bookkeeping; `merge_splits` weighs it against the idle time a
    deferred W fills)."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    p2p_latency: float = 0.0
    stage_scale: tuple[float, ...] = ()
    split: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "p2p_latency", "split"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost {name}={value} must be finite and >= 0")
        for i, value in enumerate(self.stage_scale):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"stage_scale[{i}]={value} must be finite and >= 0")

    def of(self, kind: ActionKind, stage: int = 0) -> float:
        """Duration of an action of ``kind`` on ``stage`` (p2p actions take no rank time)."""
        base = {K.F: self.f, K.B: self.b, K.W: self.w + self.split, K.BW: self.b + self.w}.get(kind, 0.0)
        return base * self.stage_scale[stage] if self.stage_scale else base


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One action of one rank with its simulated start and end (receives: the wait)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """What `simulate` measured; ``timeline[r]`` lists rank ``r``'s actions in order."""

    schedule: Schedule
    costs: Costs
    makespan: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_held: tuple[int, ...]
    timeline: tuple[tuple[TimedAction, ...], ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Idle time of each rank: ``makespan - busy``."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def mean_bubble(self) -> float:
        """The bubble fraction averaged over ranks."""
        return math.fsum(self.bubble) / len(self.bubble)

    def compute_actions(self) -> tuple[TimedAction, ...]:
        """All compute actions (F, B, W, BW) of all ranks."""
        return tuple(t for row in self.timeline for t in row if t.action.is_compute)


def activation_peaks(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(peak_in_flight, peak_held)`` per rank, as defined in the module docstring."""
    in_flight_peaks: list[int] = []
    held_peaks: list[int] = []
    for acts in schedule.actions:
        in_flight = held = peak_f = peak_h = 0
        for a in acts:
            if a.kind is K.F:
                in_flight += 1
                held += 1
            elif a.kind is K.B:
                in_flight -= 1
            elif a.kind is K.W:
                held -= 1
            elif a.kind is K.BW:
                in_flight -= 1
                held -= 1
            peak_f, peak_h = max(peak_f, in_flight), max(peak_h, held)
        in_flight_peaks.append(peak_f)
        held_peaks.append(peak_h)
    return tuple(in_flight_peaks), tuple(held_peaks)


def timed(
    schedule: Schedule, costs: Costs, rows: bool = True
) -> tuple[float, tuple[float, ...], list[list[TimedAction]]]:
    """``(makespan, busy per rank, timeline rows)`` of ``schedule`` under ``costs``, without
    validating it first (`simulate` does; `merge_splits` and the planner time many schedules
    built valid) or, with ``rows=False``, the per-action rows. A rank left waiting for a
    message never sent raises ValueError."""
    of = {(k, st): costs.of(k, st) for k in (K.F, K.B, K.W, K.BW) for st in range(schedule.num_stages)}
    durations = [[of.get((a.kind, a.stage), 0.0) for a in row] for row in schedule.actions]
    return _clock(schedule, durations, costs.p2p_latency, rows)


def replay(schedule: Schedule, timelines: Sequence[Sequence[TimedAction]]) -> float:
    """The step ``schedule`` would take with the compute durations of ``timelines`` (one
    measured step: every rank's `StepResult.timeline`) and instant messages: the length of
    its critical path, what no runtime of this schedule can beat with these computations.

    A unit the runtime ran as one BW where the schedule has B and W (the timeline shows
    that BW and no W) takes the BW's time at the B. ValueError if a compute action of the
    schedule has no measured time."""
    measured: dict[tuple[ActionKind, int, int], float] = {}
    for row in timelines:
        for t in row:
            if t.action.is_compute:
                measured[(t.action.kind, t.action.microbatch, t.action.stage)] = t.end - t.start
    durations: list[list[float]] = []
    for acts in schedule.actions:
        out = []
        for a in acts:
            if not a.is_compute:
                out.append(0.0)
                continue
            unit = (a.microbatch, a.stage)
            seconds = measured.get((a.kind, *unit))
            if seconds is None and (K.BW, *unit) in measured and a.kind in (K.B, K.W):
                seconds = measured[(K.BW, *unit)] if a.kind is K.B else 0.0
            if seconds is None:
                raise ValueError(
                    f"the timelines have no time for {a.kind.name} of microbatch {a.microbatch}, "
                    f"stage {a.stage} of schedule {schedule.name}"
                )
            out.append(seconds)
        durations.append(out)
    return _clock(schedule, durations, 0.0, rows=False)[0]


def _clock(
    schedule: Schedule, durations: Sequence[Sequence[float]], latency: float, rows: bool
) -> tuple[float, tuple[float, ...], list[list[TimedAction]]]:
    """Run every rank's actions in order, each compute taking its ``durations`` entry and
    each message ``latency`` from its send (the module docstring's model)."""
    acts = schedule.actions
    p = schedule.num_ranks
    clock = [0.0] * p
    busy = [0.0] * p
    ptr = [0] * p
    sent_at: dict[tuple[str, int, int], float] = {}
    timeline: list[list[TimedAction]] = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            row, cost = acts[r], durations[r]
            while ptr[r] < len(row):
                a = row[ptr[r]]
                start = clock[r]
                if a.kind in (K.RECV_F, K.RECV_B):
                    if a.message not in sent_at:
                        break
                    end = max(start, sent_at[a.message] + latency)
                elif a.kind in (K.SEND_F, K.SEND_B):
                    sent_at[a.message] = start
                    end = start
                else:
                    end = start + cost[ptr[r]]
                    busy[r] += end - start
                if rows:
                    timeline[r].append(TimedAction(r, a, start, end))
                clock[r] = end
                ptr[r] += 1
                moved = True
    stuck = [r for r in range(p) if ptr[r] < len(acts[r])]
    if stuck:  # only an unvalidated schedule gets here
        raise ValueError(f"schedule {schedule.name} deadlocks: ranks {stuck} wait for messages never sent")
    return max(clock), tuple(busy), timeline


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Validate ``schedule``, then time it under ``costs`` (default: F = B = W = 1, no latency)."""
    costs = costs or Costs()
    validate(schedule)
    if costs.stage_scale and len(costs.stage_scale) != schedule.num_stages:
        raise ValueError(
            f"costs.stage_scale has {len(costs.stage_scale)} entries for {schedule.num_stages} stages"
        )
    makespan, busy, rows = timed(schedule, costs)
    bubble = tuple((makespan - b) / makespan if makespan > 0 else 0.0 for b in busy)
    peak_in_flight, peak_held = activation_peaks(schedule)
    return SimResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        busy=busy,
        bubble=bubble,
        peak_in_flight=peak_in_flight,
        peak_held=peak_held,
        timeline=tuple(tuple(row) for row in rows),
    )
