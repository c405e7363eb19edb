"""Tessera pipeline parallelism: partitioner, schedules as data, validator, simulator, runtime.

The pure half (no processes): split a model into stages, generate a schedule (per-rank
action lists), validate it, time it, and draw it. The runtime (`PipelineRuntime`) executes
a schedule over torch.distributed p2p, one instance per rank.
"""

from __future__ import annotations

from tessera.pipeline.actions import COMPUTE_KINDS, P2P_KINDS, Action, ActionKind, Schedule
from tessera.pipeline.partition import (
    Balance,
    Layout,
    Partition,
    partition_by_cost,
    partition_by_params,
    partition_by_profile,
    rank_of_stage,
    stage_to_rank,
)
from tessera.pipeline.render import chrome_trace, timeline_png
from tessera.pipeline.runtime import LossFn, PipelineAborted, PipelineRuntime, StepResult, stage_modules
from tessera.pipeline.schedules import (
    SCHEDULE_LAYOUTS,
    SCHEDULES,
    ScheduleFn,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_stage_to_rank,
    zbv,
    zero_bubble_h1,
)
from tessera.pipeline.simulate import Costs, SimResult, TimedAction, activation_peaks, simulate
from tessera.pipeline.validate import P2PModel, validate

__all__ = [
    "COMPUTE_KINDS",
    "P2P_KINDS",
    "SCHEDULES",
    "SCHEDULE_LAYOUTS",
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
    "ScheduleFn",
    "SimResult",
    "StepResult",
    "TimedAction",
    "activation_peaks",
    "build_schedule",
    "chrome_trace",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "partition_by_cost",
    "partition_by_params",
    "partition_by_profile",
    "rank_of_stage",
    "schedule_stage_to_rank",
    "simulate",
    "stage_modules",
    "stage_to_rank",
    "timeline_png",
    "validate",
    "zbv",
    "zero_bubble_h1",
]
