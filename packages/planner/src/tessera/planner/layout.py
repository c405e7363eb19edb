"""What the planner plans: a `Layout` (how a job is split over its ranks) and a `Job` (the
model, its global batch, precision and optimizer), and `check`, the rules of a layout the
planner knows itself.

A layout is the degrees ``dp * pp * tp * cp``, the tensor-parallel mode (`TPMode`, with the
2.5D ``tp_depth``), context parallelism (``cp_mode``: ring or Ulysses; ``cp_layout``:
contiguous or zigzag chunks of the sequence; comm's ``sequence_modes`` enums), Megatron
sequence parallelism, the pipeline schedule (``virtual_stages`` chunks per rank for the
interleaved ones, ``microbatches`` per step, ``tune_splits``: the zero-bubble split tuning
steps, 0 off), the ZeRO stage with or without CPU offload, and activation checkpointing per
layer (``recompute``); with a mixture of experts (``Job.moe``), the expert-parallel degree
``ep`` (of the data-parallel ranks).

`check` refuses what the planner cannot model (degrees below 1, a tensor-parallel degree
that is no grid of its mode, an unknown schedule or one whose rules refuse the pipeline
ranks, microbatches and chunks, an unknown precision or optimizer, a batch the data
parallelism and microbatches do not divide). The rules of the model a caller runs (heads,
widths and vocabularies that must split) belong to whoever builds it: `search` takes them
as its ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.comm import Parallelism, TPGrid, TPMode
from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.comm.sequence_modes import Mode as ContextMode
from tessera.pipeline import SCHEDULES, schedule_spec
from tessera.planner.memory import DTYPE_BYTES, OPTIMIZER_BYTES
from tessera.planner.model import ModelShape, TPShape

if TYPE_CHECKING:
    from tessera.planner.experts import ExpertShape

__all__ = ["Job", "Layout", "check"]


@dataclass(frozen=True, slots=True)
class Layout(Parallelism):
    """How a job is split over ``dp * pp * tp * cp`` ranks and run (its `Parallelism`, which the
    launcher's ``[parallel]`` section is too), its ZeRO stage, offload and recompute."""

    zero: int = 0
    offload: bool = False
    recompute: bool = False

    def __post_init__(self) -> None:  # names and members alike ("2d", TPMode.TWO_D)
        for name, enum in (("tp_mode", TPMode), ("cp_mode", ContextMode), ("cp_layout", ContextLayout)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                known = ", ".join(m.value for m in enum)
                raise ValueError(f"layout.{name}={value!r} is not one of {known}") from None

    @property
    def shape(self) -> TPShape:
        """How its tensor parallelism splits the model."""
        return TPShape(self.tp_mode.value, self.tp, self.tp_depth)

    def label(self) -> str:
        """A short description of the degrees, schedule and ZeRO stage."""
        tp = (
            f"tp{self.tp}"
            + ("" if self.tp_mode is TPMode.ONE_D else f"/{self.tp_mode.value}")
            + (f"d{self.tp_depth}" if self.tp_depth > 1 else "")
        )
        tp += "+sp" if self.sequence_parallel else ""
        parts = [f"dp{self.dp}" + (f"/ep{self.ep}" if self.ep > 1 else ""), f"pp{self.pp}", tp]
        if self.cp > 1:
            parts.append(f"cp{self.cp}/{self.cp_mode.value}")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts.append(f"m{self.microbatches}")
        parts.append(f"z{self.zero}" + ("+off" if self.offload else ""))
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Job:
    """The model (with its global batch), the compute precision and the optimizer; and
    whether the job as given checkpoints activations (``recompute``: what the search asks
    ``validate`` about a layout's family with, before it tries both). ``moe``: the MLPs of
    the first ``moe.layers`` layers are mixtures of experts (`tessera.planner.experts`)."""

    model: ModelShape
    precision: str = "fp32"
    optimizer: str = "adamw"
    recompute: bool = False
    moe: ExpertShape | None = None


def check(layout: Layout, job: Job) -> list[str]:
    """What keeps the planner from modelling ``layout`` for ``job``, one line each naming
    the values (empty when it can)."""
    lines: list[str] = []
    for name in ("dp", "pp", "tp", "cp", "tp_depth", "microbatches", "virtual_stages", "ep"):
        value = getattr(layout, name)
        if value < 1:
            lines.append(f"layout.{name} must be >= 1, got {value}")
    if lines:
        return lines
    try:  # the grid of the mode (tessera.comm's geometry)
        TPGrid.of(layout.tp_mode, layout.tp, layout.tp_depth)
    except ValueError as e:
        lines.append(f"layout: {e}")
    if layout.schedule not in SCHEDULES:
        lines.append(f"layout.schedule={layout.schedule!r} is not one of {', '.join(sorted(SCHEDULES))}")
    else:  # the schedule's own rules (tessera.pipeline's spec), each line naming pp and m
        pp, m = layout.pp, layout.microbatches
        rules = schedule_spec(layout.schedule).check(pp, m, layout.virtual_stages)
        lines += [f"layout (pp={pp}, microbatches={m}): {line}" for line in rules]
    if not 0 <= layout.zero <= 3:
        lines.append(f"layout.zero={layout.zero} must be 0, 1, 2 or 3")
    if layout.tune_splits < 0:
        lines.append(f"layout.tune_splits must be >= 0, got {layout.tune_splits}")
    if job.precision not in DTYPE_BYTES:
        lines.append(f"job.precision={job.precision!r} is not one of {', '.join(DTYPE_BYTES)}")
    if job.optimizer not in OPTIMIZER_BYTES:
        lines.append(f"job.optimizer={job.optimizer!r} is not one of {', '.join(OPTIMIZER_BYTES)}")
    lines += _expert_lines(layout, job)
    per_step = layout.dp * layout.microbatches
    if job.model.batch % per_step:
        lines.append(
            f"job: batch {job.model.batch} is not divisible by dp * microbatches "
            f"= {layout.dp} * {layout.microbatches} = {per_step}"
        )
    return lines


def _expert_lines(layout: Layout, job: Job) -> list[str]:
    """What the planner cannot model of a layout's experts (`tessera.planner.experts`)."""
    moe, ep = job.moe, layout.ep
    if moe is None:
        return [f"layout.ep={ep} but the job has no experts (job.moe)"] if ep > 1 else []
    lines = []
    if layout.dp % ep or moe.experts % ep:
        lines.append(f"layout.ep={ep} must divide dp={layout.dp} and the experts ({moe.experts})")
    if layout.pp > 1 or layout.cp > 1:
        lines.append(f"job.moe: experts are modelled at pp = cp = 1, got pp={layout.pp} cp={layout.cp}")
    if layout.tp > 1 and layout.tp_mode is not TPMode.ONE_D:
        lines.append(f"job.moe: experts are modelled under 1D tp, got tp={layout.tp} {layout.tp_mode.value}")
    if moe.layers > job.model.layers:
        lines.append(f"job.moe.layers={moe.layers} is more than the model's {job.model.layers} layers")
    return lines
