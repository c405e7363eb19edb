"""Keep the splits that pay on this machine: the first steps measure, then `merge_splits`.

`PipelineRuntime(..., tune_splits=n)` with a split-backward schedule runs its first ``n + 1``
steps by the schedule as built and the next ``n + 1`` by its `unsplit` form (the first step of
each is a warm-up and is not measured). Every rank then gathers the timelines and step times
of the measured steps over the group, fits the costs (`fit_costs`: F, B, W and BW per stage,
and what the split adds) and builds `merge_splits` of the schedule under them. The model
behind the merge leaves out what the timelines do not show (message latency, waits), so
the merged schedule runs ``n + 1`` steps of its own too, and the runtime keeps, for every
later step, whichever of the three forms took the least time (per step the slowest rank's
time, the median over the measured steps). A merge that changes nothing is not run again.

All of these steps compute the same gradients (one backward, or its two halves), so training
goes on while it measures. The figures are gathered over the runtime's ``tune_group`` (the
whole job by default), so every rank decides the same: the pipelines of one job must run
one order where their ranks also meet in other collectives (the tensor-parallel peers of a
stage sit in different pipeline groups, and run B's and W's collectives in schedule order).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tessera.comm import Group, group_size
from tessera.pipeline.actions import Schedule
from tessera.pipeline.merge import fit_costs, merge_splits, unsplit
from tessera.pipeline.simulate import Costs, TimedAction

__all__ = ["SplitTuner"]

logger = logging.getLogger(__name__)


class SplitTuner:
    """Which form of the schedule each tuning step runs, what they measured, and the choice.

    Once ``done``: ``costs`` (fitted), ``step_seconds`` (each form's median step, its slowest
    rank per step), ``form`` (the name of the one kept: "as built", "unsplit" or "merged")
    and ``chosen`` (that schedule)."""

    def __init__(self, schedule: Schedule, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"tune_splits={steps}: measure at least 1 step of each form (0: off)")
        self.built = schedule
        self.steps = steps
        self._forms: list[tuple[str, Schedule]] = [("as built", schedule), ("unsplit", unsplit(schedule))]
        self._step = 0  # steps run since tuning began
        self._timelines: list[tuple[TimedAction, ...]] = []
        self._seconds: dict[str, list[float]] = {}  # form -> this rank's measured step times
        self.done = False
        self.costs: Costs | None = None
        self.chosen: Schedule = schedule
        self.form = "as built"
        self.step_seconds: dict[str, float] = {}

    def next_schedule(self, group: Group) -> Schedule:
        """The schedule of the next step. Where a form's steps end, this gathers what they
        measured over ``group`` (collective) and adds the merged form or makes the choice."""
        per_form = self.steps + 1
        form = self._step // per_form
        if form < len(self._forms) and (self._step % per_form or form < 2):
            return self._forms[form][1]
        every: list[Any] = [None] * group_size(group)
        fitting = form == 2 and len(self._forms) == 2  # the split and unsplit forms are measured
        dist.all_gather_object(every, (self._timelines if fitting else [], self._seconds), group=group)
        if fitting:
            self.costs = fit_costs([t for timelines, _ in every for t in timelines], self.built.num_stages)
            merged = merge_splits(self.built, self.costs)
            if merged not in (schedule for _, schedule in self._forms):
                self._forms.append(("merged", merged))
                return merged
        return self._choose([seconds for _, seconds in every])

    def record(self, timeline: Sequence[TimedAction], seconds: float) -> None:
        """What the step just run took on this rank (kept unless it warmed a form up)."""
        per_form = self.steps + 1
        form = self._step // per_form
        if self._step % per_form:
            name = self._forms[form][0]
            self._seconds.setdefault(name, []).append(seconds)
            if form < 2:
                self._timelines.append(tuple(timeline))
        self._step += 1

    def _choose(self, per_rank: list[dict[str, list[float]]]) -> Schedule:
        """The form whose steps were fastest (each step: its slowest rank; median)."""
        times = {
            name: statistics.median(max(ranks) for ranks in zip(*(r[name] for r in per_rank), strict=True))
            for name, _ in self._forms
        }
        name, self.chosen = min(self._forms, key=lambda item: times[item[0]])
        self.form, self.step_seconds = name, times
        self.done = True
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
            ", ".join(f"{form} {t * 1e3:.1f} ms" for form, t in times.items()),
            name,
            len(self.chosen.split_units()),
            len(self.built.split_units()),
        )
        return self.chosen
