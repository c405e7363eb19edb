"""Keep the splits that pay on this machine: the first steps measure, then `merge_splits`.

`PipelineRuntime(..., tune_splits=n)` with a split-backward schedule measures its forms in
pairs of steps run back to back, so that a machine whose speed drifts (other jobs, clock
changes) favours neither side of a comparison:

1. one step of the schedule as built and one of its `unsplit` form (warm-ups, not measured),
   then ``n`` pairs: as built, unsplit;
2. every rank gathers the timelines and step times over the group, fits the costs
   (`fit_costs`: F, B, W and BW per stage, and what the split adds) and builds `merge_splits`
   of the schedule under them. The model behind the merge leaves out what the timelines do
   not show (message latency, waits), so a merge that runs differently from both (compared
   as `fuse_adjacent` of each, what the runtime runs) gets one warm-up step and ``n``
   pairs of its own: merged, then the better of the first two;
3. the form kept for every later step is the one faster in the median pair (per step the
   slowest rank's time; the ratio within each pair; the median of the ratios).

All of these steps compute the same gradients (one backward, or its two halves), so training
goes on while it measures: ``2n + 2`` steps, plus ``2n + 1`` when the merge is new
(`tuning_steps`). The figures are gathered over the runtime's ``tune_group`` (the whole job
by default), so every rank decides the same: the pipelines of one job must run one order
where their ranks also meet in other collectives (the tensor-parallel peers of a stage sit
in different pipeline groups, and run B's and W's collectives in schedule order).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tessera.comm import Group, group_size
from tessera.pipeline.actions import Schedule
from tessera.pipeline.merge import fit_costs, fuse_adjacent, merge_splits, unsplit
from tessera.pipeline.simulate import Costs, TimedAction

__all__ = ["SplitTuner", "tuning_steps"]

logger = logging.getLogger(__name__)

BUILT, UNSPLIT, MERGED = "as built", "unsplit", "merged"


def tuning_steps(n: int) -> int:
    """The most steps `SplitTuner` measures with ``tune_splits=n`` (the merge new)."""
    return 4 * n + 3 if n > 0 else 0


class SplitTuner:
    """Which form of the schedule each tuning step runs, what they measured, and the choice.

    Once ``done``: ``costs`` (fitted), ``step_seconds`` (each measured form's median step, its
    slowest rank per step), ``form`` (the name of the one kept: "as built", "unsplit" or
    "merged") and ``chosen`` (that schedule)."""

    def __init__(self, schedule: Schedule, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"tune_splits={steps}: measure at least 1 pair of steps (0: off)")
        self.built = schedule
        self.steps = steps
        self.forms: dict[str, Schedule] = {BUILT: schedule, UNSPLIT: unsplit(schedule)}
        self._plan = self._pairs(BUILT, UNSPLIT)  # the form of each step still to run
        self._ran: list[tuple[str, bool]] = []  # (form, measured) of every step run
        self._seconds: list[float] = []  # this rank's time of every step run
        self._timelines: list[tuple[TimedAction, ...]] = []  # of the measured steps
        self._times: dict[str, list[float]] = {}  # form -> the group's slowest rank per step
        self._rival: str | None = None  # the better of the first two, measured against the merge
        self.done = False
        self.costs: Costs | None = None
        self.chosen: Schedule = schedule
        self.form = BUILT
        self.step_seconds: dict[str, float] = {}

    def _pairs(self, first: str, second: str, warm: Sequence[str] | None = None) -> list[tuple[str, bool]]:
        """Warm-up steps (``warm``, default both forms), then ``steps`` pairs, measured."""
        warmups = [(form, False) for form in (warm if warm is not None else (first, second))]
        return warmups + [(form, True) for _ in range(self.steps) for form in (first, second)]

    def next_schedule(self, group: Group) -> Schedule:
        """The schedule of the next step. Where a phase's steps end, this gathers what they
        measured over ``group`` (collective) and plans the merged form's steps or chooses."""
        if not self._plan:
            self._gather(group)
            if self._rival is None:
                return self._after_first()
            return self._finish(self._faster(MERGED, self._rival))
        return self.forms[self._plan[0][0]]

    def record(self, timeline: Sequence[TimedAction], seconds: float) -> None:
        """What the step just run took on this rank."""
        form, measured = self._plan.pop(0)
        self._ran.append((form, measured))
        self._seconds.append(seconds)
        if measured and self._rival is None:
            self._timelines.append(tuple(timeline))

    def _gather(self, group: Group) -> None:
        """Every rank's step times (and, after the first phase, timelines) over ``group``."""
        first = self._rival is None
        every: list[Any] = [None] * group_size(group)
        dist.all_gather_object(every, (self._timelines if first else [], self._seconds), group=group)
        slowest = [max(step) for step in zip(*(seconds for _, seconds in every), strict=True)]
        self._times = {}
        for (form, measured), t in zip(self._ran, slowest, strict=True):
            if measured:
                self._times.setdefault(form, []).append(t)
        if first:
            self.costs = fit_costs([t for timelines, _ in every for t in timelines], self.built.num_stages)
        self._ran, self._seconds = [], []
        for form, times in self._times.items():
            self.step_seconds[form] = statistics.median(times)

    def _faster(self, a: str, b: str) -> str:
        """``a`` or ``b``: the one faster in the median of their paired steps' ratios."""
        ratio = statistics.median(x / y for x, y in zip(self._times[a], self._times[b], strict=True))
        return a if ratio < 1.0 else b

    def _after_first(self) -> Schedule:
        """Build the merge under the fitted costs; measure it against the better form so far
        if it runs differently from both (the runtime runs `fuse_adjacent` of each), else
        choose now."""
        assert self.costs is not None
        best = self._faster(BUILT, UNSPLIT)
        merged = merge_splits(self.built, self.costs)
        if fuse_adjacent(merged) in [fuse_adjacent(form) for form in self.forms.values()]:
            return self._finish(best)
        self.forms[MERGED], self._rival = merged, best
        self._plan = self._pairs(MERGED, best, warm=(MERGED,))
        return merged

    def _finish(self, name: str) -> Schedule:
        self.form, self.chosen, self.done = name, self.forms[name], True
        costs = self.costs
        assert costs is not None
        logger.info(
            "pipeline %s: measured F %.2f ms, B %.2f ms, W %.2f ms per unit, the split adds %.2f ms; "
            "steps %s; runs it %s (%d of %d split backwards)",
            self.built.name,
            costs.f * 1e3,
            costs.b * 1e3,
            (costs.w + costs.split) * 1e3,
            costs.split * 1e3,
            ", ".join(f"{form} {t * 1e3:.1f} ms" for form, t in self.step_seconds.items()),
            name,
            len(self.chosen.split_units()),
            len(self.built.split_units()),
        )
        return self.chosen
