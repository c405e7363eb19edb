"""Keep the splits that pay on this machine: the first steps measure, then `merge_splits`.

`PipelineRuntime(..., tune_splits=n)` with a split-backward schedule runs its first ``n + 1``
steps by the schedule as built and the next ``n + 1`` by its `unsplit` form (the first step of
each is a warm-up and is not measured), then gathers every rank's timelines of the measured
steps over the group, fits the costs (`fit_costs`: F, B, W and BW per stage, and what the
split adds) and runs every later step by `merge_splits` of the schedule under those costs.
All of these steps compute the same gradients (one backward, or its two halves), so training
goes on while it measures. Every rank computes the same merged schedule from the same
gathered timelines.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from tessera.comm import Group, group_size
from tessera.pipeline.actions import ActionKind, Schedule
from tessera.pipeline.merge import fit_costs, merge_splits, unsplit
from tessera.pipeline.simulate import Costs, TimedAction, simulate

__all__ = ["SplitTuner"]

logger = logging.getLogger(__name__)


class SplitTuner:
    """The schedule of each tuning step, the timelines measured, and the merge at the end."""

    def __init__(self, schedule: Schedule, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"tune_splits={steps}: measure at least 1 step of each form (0: off)")
        self.built = schedule
        self._plan = [form for form in (schedule, unsplit(schedule)) for _ in range(steps + 1)]
        self._step = 0
        self._timelines: list[tuple[TimedAction, ...]] = []
        self.done = False
        self.costs: Costs | None = None

    def next_schedule(self, group: Group) -> Schedule:
        """The schedule of the next step. After the last measured step this gathers the
        timelines over ``group`` (collective) and returns the merged schedule, once."""
        if self._step < len(self._plan):
            return self._plan[self._step]
        self.done = True
        return self._merge(group)

    def record(self, timeline: Sequence[TimedAction]) -> None:
        """The timeline of the step just run (kept unless it warmed a form up)."""
        steps = len(self._plan) // 2
        if self._step % steps:
            self._timelines.append(tuple(timeline))
        self._step += 1

    def _merge(self, group: Group) -> Schedule:
        every: list[Any] = [None] * group_size(group)
        dist.all_gather_object(every, self._timelines, group=group)
        timelines = [t for rank in every for t in rank]
        self.costs = costs = fit_costs(timelines, self.built.num_stages)
        merged = merge_splits(self.built, costs)
        kept = sum(a.kind is ActionKind.W for acts in merged.actions for a in acts)
        total = sum(a.kind is ActionKind.W for acts in self.built.actions for a in acts)
        logger.info(
            "pipeline %s: measured F %.2f ms, B %.2f ms, W %.2f ms per unit, the split adds %.2f ms; "
            "keeps %d of %d split backwards (simulated step %.1f ms as built, %.1f ms merged)",
            self.built.name,
            costs.f * 1e3,
            costs.b * 1e3,
            (costs.w + costs.split) * 1e3,
            costs.split * 1e3,
            kept,
            total,
            simulate(self.built, costs).makespan * 1e3,
            simulate(merged, costs).makespan * 1e3,
        )
        return merged
