"""Tessera pipeline parallelism: partitioner, schedules as data, validator, simulator, runtime.

The pure half (no processes): look a schedule up in the registry (`schedule_spec`), check a
configuration against its rules, build it (per-rank action lists), split a model into the
stages it places, validate it, time it, and draw it. The runtime (`PipelineRuntime`)
executes a schedule over torch.distributed p2p, one instance per rank.
"""

from __future__ import annotations

from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.forward import forward_loss
from tessera.pipeline.layout import Layout, stage_to_rank
from tessera.pipeline.partition import (
    Balance,
    Partition,
    partition_by_cost,
    partition_by_params,
    partition_by_profile,
)
from tessera.pipeline.registry import SCHEDULES, build_schedule, register_schedule, schedule_spec
from tessera.pipeline.render import chrome_trace, timeline_png
from tessera.pipeline.runtime import LossFn, PipelineAborted, PipelineRuntime, StepResult, stage_modules
from tessera.pipeline.schedules import gpipe, interleaved_1f1b, one_f_one_b
from tessera.pipeline.simulate import Costs, SimResult, TimedAction, simulate
from tessera.pipeline.spec import ScheduleSpec
from tessera.pipeline.validate import P2PModel, validate
from tessera.pipeline.zero_bubble import zbv, zero_bubble_h1

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
    "forward_loss",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "partition_by_cost",
    "partition_by_params",
    "partition_by_profile",
    "register_schedule",
    "schedule_spec",
    "simulate",
    "stage_modules",
    "stage_to_rank",
    "timeline_png",
    "validate",
    "zbv",
    "zero_bubble_h1",
]
