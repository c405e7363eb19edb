"""Tessera pipeline parallelism: partitioner, schedules as data, validator, simulator, runtime.

The pure half (no processes): look a schedule up in the registry (`schedule_spec`), check a
configuration against its rules, build it (per-rank action lists), split a model into the
stages it places, validate it, time it, and draw it. The runtime (`PipelineRuntime`)
executes a schedule over torch.distributed p2p, one instance per rank.

Importing the package does not import torch: the pure half is loaded at once, the runtime
(`PipelineRuntime`, `StepResult`, `LossFn`, `PipelineAborted`, `stage_modules`,
`forward_loss`) on first use (PEP 562 ``__getattr__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports
from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.layout import Layout, stage_to_rank
from tessera.pipeline.merge import fit_costs, fuse_adjacent, merge_splits, unsplit
from tessera.pipeline.microbatch import split_microbatches
from tessera.pipeline.partition import (
    Balance,
    Partition,
    partition_by_cost,
    partition_by_params,
    partition_by_profile,
)
from tessera.pipeline.registry import SCHEDULES, build_schedule, register_schedule, schedule_spec
from tessera.pipeline.render import chrome_trace, timeline_png
from tessera.pipeline.schedules import gpipe, interleaved_1f1b, one_f_one_b
from tessera.pipeline.simulate import Costs, SimResult, TimedAction, replay, simulate
from tessera.pipeline.spec import ScheduleSpec
from tessera.pipeline.validate import P2PModel, validate
from tessera.pipeline.zero_bubble import zbv, zero_bubble_h1

if TYPE_CHECKING:
    from tessera.pipeline.forward import forward_loss
    from tessera.pipeline.runtime import LossFn, PipelineAborted, PipelineRuntime, StepResult, stage_modules

# the submodules that need torch: the names of __all__ not imported above come from them
_LAZY = ("forward", "runtime")

if not TYPE_CHECKING:  # hidden from mypy, which then checks every name as imported above
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Balance",
    "Costs",
    "Layout",
    "LossFn",
    "P2PModel",
    "Partition",
    "PipelineAborted",
    "PipelineRuntime",
    "Schedule",
    "ScheduleSpec",
    "SimResult",
    "StepResult",
    "TimedAction",
    "build_schedule",
    "chrome_trace",
    "fit_costs",
    "forward_loss",
    "fuse_adjacent",
    "gpipe",
    "interleaved_1f1b",
    "merge_splits",
    "one_f_one_b",
    "partition_by_cost",
    "partition_by_params",
    "partition_by_profile",
    "register_schedule",
    "replay",
    "schedule_spec",
    "simulate",
    "split_microbatches",
    "stage_modules",
    "stage_to_rank",
    "timeline_png",
    "unsplit",
    "validate",
    "zbv",
    "zero_bubble_h1",
]
