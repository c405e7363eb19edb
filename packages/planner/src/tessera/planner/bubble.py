"""Pipeline makespans and in-flight activations from the pipeline's own simulator.

`pipeline_profile` builds the named schedule from the registry and runs
``tessera.pipeline.simulate`` with costs in units of one forward (``f = 1``): the makespan
in those units and each rank's ``peak_held`` (microbatch x chunk units whose activations are
alive). Results are cached by their arguments, so a search that tries many data- and
tensor-parallel shapes over the same pipeline simulates it once.

Very long pipelines (more than ``EXACT_LIMIT`` compute actions) are simulated at the two
smallest microbatch counts ``2p <= m1``, ``m1 + p <= m2`` that the schedule accepts and extrapolated
linearly in ``m`` (one pair of simulations serves every larger ``m``):
every registered schedule reaches its steady state by ``m = 2p`` (checked for p = 2, 4, 8), after
which each extra microbatch adds the same time and the same (often zero) activations.
Those long runs are timed by the simulator's own timing model (`tessera.pipeline.simulate.
timed`) without the per-action timeline and without validating again a schedule the
registry built, which took most of the search's time at a thousand GPUs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tessera.pipeline import Costs, Schedule, build_schedule, fuse_adjacent, schedule_spec, simulate, unsplit
from tessera.pipeline.simulate import activation_peaks, timed

__all__ = ["EXACT_LIMIT", "PipelineProfile", "pipeline_profile"]


EXACT_LIMIT = 600  # compute actions simulated exactly; beyond: two smaller runs, extrapolated


@dataclass(frozen=True, slots=True)
class PipelineProfile:
    """A simulated schedule: makespan (in forwards) and per-rank peak held units."""

    makespan: float
    busy: float  # the busiest rank's compute time
    peak_held: tuple[float, ...]
    extrapolated: bool = False
    split_backward: bool = False  # the schedule runs weight gradients (W) apart from B

    @property
    def bubble(self) -> float:
        """Idle fraction of the busiest rank."""
        return 1.0 - self.busy / self.makespan if self.makespan > 0 else 0.0


def _build(name: str, p: int, m: int, v: int, whole: bool) -> Schedule:
    """The registry's schedule as the runtime runs it (`fuse_adjacent`: a B its W directly
    follows is one BW), or its `unsplit` form (every backward one BW) when ``whole``."""
    schedule = build_schedule(name, p, m, v)
    return unsplit(schedule) if whole else fuse_adjacent(schedule)


def _simulate(name: str, p: int, m: int, v: int, costs: Costs, whole: bool = False) -> PipelineProfile:
    if p * m * schedule_spec(name).chunks(v) * 3 > EXACT_LIMIT:  # long: timed without validation
        schedule, peaks = _long(name, p, m, v, whole)
        makespan, busy, _ = timed(schedule, costs, rows=False)
        return PipelineProfile(makespan, max(busy), peaks, split_backward=schedule.split_backward)
    schedule = _build(name, p, m, v, whole)
    result = simulate(schedule, costs)
    return PipelineProfile(
        result.makespan,
        max(result.busy),
        tuple(float(x) for x in result.peak_held),
        split_backward=schedule.split_backward,
    )


@functools.lru_cache(maxsize=8)
def _long(name: str, p: int, m: int, v: int, whole: bool) -> tuple[Schedule, tuple[float, ...]]:
    """A long schedule the registry built, and each rank's peak held units (kept for a few
    schedules: a search rarely times the same long schedule twice, and each takes a few MiB)."""
    schedule = _build(name, p, m, v, whole)
    return schedule, tuple(float(x) for x in activation_peaks(schedule)[1])


def _small_counts(name: str, p: int, v: int) -> tuple[int, int] | None:
    """The smallest microbatch count ``m1 >= 2p`` the schedule accepts, and the smallest
    ``m2 >= m1 + p`` (a whole period later, so alternating patterns do not bend the line)."""
    spec = schedule_spec(name)
    m1 = next((k for k in range(2 * p, 8 * p + 1) if not spec.check(p, k, v)), None)
    if m1 is None:
        return None
    m2 = next((k for k in range(m1 + p, m1 + 8 * p + 1) if not spec.check(p, k, v)), None)
    return None if m2 is None else (m1, m2)


@functools.lru_cache(maxsize=4096)
def _steady(
    name: str, p: int, v: int, costs: Costs, whole: bool = False
) -> tuple[int, PipelineProfile, int, PipelineProfile] | None:
    small = _small_counts(name, p, v)
    if small is None:
        return None
    m1, m2 = small
    return m1, _simulate(name, p, m1, v, costs, whole), m2, _simulate(name, p, m2, v, costs, whole)


@functools.lru_cache(maxsize=8192)
def pipeline_profile(
    name: str,
    p: int,
    m: int,
    v: int,
    b: float,
    w: float,
    latency: float,
    scale: tuple[float, ...] = (),
    split: float = 0.0,
    whole: bool = False,
) -> PipelineProfile:
    """The schedule ``name`` for ``p`` ranks, ``m`` microbatches and ``v`` chunks per rank,
    timed with a forward of 1, backward-for-input ``b``, backward-for-weight ``w``, a split
    backward's extra ``split`` (`Costs.split`) and a p2p latency of ``latency`` (all in
    forwards), each stage's actions scaled by ``scale`` (its work against the heaviest
    stage's; empty: all equal) when simulated exactly; beyond ``EXACT_LIMIT`` actions every
    stage costs the heaviest's. ``whole``: the schedule's `unsplit` form."""
    chunks = schedule_spec(name).chunks(v)
    if p * m * chunks * 3 <= EXACT_LIMIT:
        costs = Costs(f=1.0, b=b, w=w, p2p_latency=latency, stage_scale=scale, split=split)
        return _simulate(name, p, m, v, costs, whole)
    # Long pipelines: every stage at the heaviest one's cost, so that the two extrapolation
    # runs are shared by every cut of the same schedule (``estimate.shape_of`` agrees).
    costs = Costs(f=1.0, b=b, w=w, p2p_latency=latency, split=split)
    steady = _steady(name, p, v, costs, whole)
    if steady is None or m < steady[0]:
        return _simulate(name, p, m, v, costs, whole)
    m1, a, m2, z = steady
    k = (m - m1) / (m2 - m1)
    busy = a.busy + k * (z.busy - a.busy)
    return PipelineProfile(
        max(busy, a.makespan + k * (z.makespan - a.makespan)),
        busy,
        tuple(x + k * (y - x) for x, y in zip(a.peak_held, z.peak_held, strict=True)),
        extrapolated=True,
        split_backward=a.split_backward,
    )
