"""Enumerate every layout of a job a caller accepts for a world size, predict each, rank.

The search space is every split of the world into ``dp * pp * tp * cp`` with every
tensor-parallel mode (1D with and without Megatron sequence parallelism; 2D, 2.5D at every
depth, 3D where tp is a square or cube), context parallelism (ring or Ulysses), every
registered pipeline schedule (interleaved ones at 2..``max_chunks`` chunks per rank), every
microbatch count that divides the batch, every ZeRO stage, with and without offload. Each
candidate is a `Layout`, kept only if `check` accepts it and the caller's ``validate`` (the
rules of whoever runs the job: the launcher passes its configuration's own validation)
reports nothing about it: those rules, not a copy.

Pruning, never sampling: a degree split whose parameters cannot fit one device even fully
sharded is skipped before its schedules are tried; a tensor-parallel shape that validation
refuses whatever the rest of the world does (heads or widths that do not split: the same
line with the rest all data-, all context- and all pipeline-parallel) is refused whole
(`_Validator.refused_shape`); each configuration is validated once (`_Validator`); layouts
whose lower bound on step time exceeds the ``keep``-th best found are not simulated (see
`search`); offload (which only adds time in this model) is tried only when the same
configuration without it does not fit; the zigzag
layout of context parallelism (which balances causal attention) is preferred to the
contiguous one whenever the sequence splits that way.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tessera.comm import TPMode, integer_root
from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.comm.sequence_modes import Mode as ContextMode
from tessera.comm.sequence_modes import sequence_chunks
from tessera.pipeline import SCHEDULES
from tessera.planner.cluster import Cluster
from tessera.planner.estimate import Estimate, memory_floor, overheads, predict, shape_of
from tessera.planner.layout import Job, Layout, check
from tessera.planner.memory import DTYPE_BYTES
from tessera.planner.model import ModelShape, TPShape

__all__ = ["Candidate", "SearchResult", "Validate", "divisors", "search"]

Validate = Callable[[Layout], Sequence[str]]
"""A caller's rules: the lines (one mistake each) it reports about a layout; empty: it runs it."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One valid layout and its prediction."""

    layout: Layout
    estimate: Estimate
    fits: bool

    @property
    def recompute(self) -> bool:
        """Whether the layout checkpoints activations."""
        return self.layout.recompute

    @property
    def step_time(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.estimate.time.total

    def label(self) -> str:
        """A short description of the degrees, schedule and ZeRO stage."""
        return self.layout.label()


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Ranked candidates that fit (fastest first), the ones that do not, and counts."""

    ranked: tuple[Candidate, ...]
    too_big: tuple[Candidate, ...]
    invalid: int  # candidates check or the caller's validate refused
    pruned: int  # degree splits skipped: dp does not divide the batch, or parameters cannot fit
    layouts: int  # parallel layouts examined (the rest were bounded out)
    overflow: int  # of which could not fit at any ZeRO stage (not evaluated further)

    @property
    def best(self) -> Candidate | None:
        """The fastest configuration that fits, if any."""
        return self.ranked[0] if self.ranked else None


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _tp_shapes(n: int, modes: Sequence[str]) -> Iterator[TPShape]:
    for tp in divisors(n):
        if "1d" in modes:
            yield TPShape("1d", tp)
        if tp == 1:
            continue
        if "2d" in modes and integer_root(tp, 2) is not None:
            yield TPShape("2d", tp)
        if "2.5d" in modes:
            for depth in divisors(tp)[1:]:
                q = integer_root(tp // depth, 2)
                if q is not None and q > 1:
                    yield TPShape("2.5d", tp, depth)
        if "3d" in modes and integer_root(tp, 3) is not None:
            yield TPShape("3d", tp)


def _schedules(pp: int, max_chunks: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    for name, spec in SCHEDULES.items():
        if spec.fixed_chunks:
            yield name, spec.default_chunks
        else:
            for v in range(spec.min_chunks or 1, max_chunks + 1):
                yield name, v


def _parallel_variants(
    shape: TPShape, dp: int, pp: int, cp: int, seq_len: int, recompute: bool
) -> Iterator[Layout]:
    mode = TPMode(shape.mode)
    base = Layout(dp=dp, pp=pp, tp=shape.tp, cp=cp, tp_mode=mode, tp_depth=shape.depth, recompute=recompute)
    seq_par = (False, True) if shape.mode == "1d" and shape.tp > 1 else (False,)
    modes = (ContextMode.RING, ContextMode.ULYSSES) if cp > 1 else (ContextMode.RING,)
    for sequence_parallel in seq_par:
        for cp_mode in modes:
            layout = ContextLayout.CONTIGUOUS
            zigzag = sequence_chunks(
                cp, ContextLayout.ZIGZAG, tp=shape.tp, sequence_parallel=sequence_parallel
            )
            if cp > 1 and seq_len % zigzag == 0:
                layout = ContextLayout.ZIGZAG
            yield dataclasses.replace(
                base, sequence_parallel=sequence_parallel, cp_mode=cp_mode, cp_layout=layout
            )


def _expert_variants(layouts: Iterator[Layout], job: Job) -> Iterator[Layout]:
    """Each layout at every expert-parallel degree its data parallelism and the job's experts
    allow (a job without experts: ep = 1 only)."""
    for layout in layouts:
        if job.moe is None:
            yield layout
            continue
        for ep in divisors(layout.dp):
            if job.moe.experts % ep == 0:
                yield dataclasses.replace(layout, ep=ep)


def _cannot_fit(model: ModelShape, shape: TPShape, pp: int, n: int, precision: str, cluster: Cluster) -> bool:
    """Even fully sharded (ZeRO-3 with offload), the fullest pipeline rank's device-resident
    model state exceeds a device: ``c psi / n`` unpipelined; under a pipeline the engine holds
    full parameters and gradients until the step at every stage (``accumulating()``)."""
    psi = sum(model.block_params(shape)) / pp  # the fullest rank holds at least the mean
    c = DTYPE_BYTES[precision]
    least = c * psi / n if pp == 1 else 2 * c * psi
    return least > cluster.memory_bytes


class _Validator:
    """`check` and the caller's ``validate`` of the layouts one search builds, each asked once
    (the search asks again for the same layout: a family's first microbatch count, its ZeRO
    stage 0 without offload)."""

    def __init__(self, job: Job, validate: Validate | None) -> None:
        self.job = job
        self.validate = validate
        self.seen: dict[Layout, tuple[str, ...]] = {}

    def __call__(self, layout: Layout) -> tuple[str, ...]:
        """What `check` and ``validate`` report about ``layout``."""
        lines = self.seen.get(layout)
        if lines is None:
            found = check(layout, self.job)
            if self.validate is not None:
                found += self.validate(layout)
            lines = self.seen[layout] = tuple(found)
        return lines

    def refused_shape(self, shape: TPShape, world: int) -> bool:
        """Whether validation refuses every layout of a tensor-parallel shape: a line reported
        alike with the rest of the world all data-, all context- and all pipeline-parallel
        (the lines name the numbers they depend on, so that line depends on the shape and the
        model alone: heads or widths that do not split)."""
        rest = world // shape.tp
        if rest == 1:
            return False
        common: set[str] | None = None
        mode = TPMode(shape.mode)
        for dp, cp, pp in ((rest, 1, 1), (1, rest, 1), (1, 1, rest)):
            layout = Layout(
                dp=dp,
                pp=pp,
                tp=shape.tp,
                cp=cp,
                tp_mode=mode,
                tp_depth=shape.depth,
                microbatches=1,
                recompute=self.job.recompute,
            )
            lines = set(self(layout))
            common = lines if common is None else common & lines
            if not common:
                return False
        return True

    def refused_whole(self, layout: Layout, counts: Sequence[int]) -> bool:
        """Whether validation refuses the family for a reason independent of the microbatch
        count: a line reported alike at its smallest and its largest count."""
        first = self(dataclasses.replace(layout, microbatches=counts[0]))
        if not first:
            return False
        return bool(set(first) & set(self(dataclasses.replace(layout, microbatches=counts[-1]))))


def search(
    job: Job,
    cluster: Cluster,
    *,
    world: int | None = None,
    validate: Validate | None = None,
    tp_modes: Sequence[str] = ("1d", "2d", "2.5d", "3d"),
    max_chunks: int = 4,
    recompute: Sequence[bool] = (False,),
    keep: int = 20,
) -> SearchResult:
    """Every valid layout of ``job`` on ``world`` ranks of ``cluster`` (default: all its
    devices), predicted and ranked by step time among those that fit. Valid: `check`
    accepts it and ``validate`` (when given: the caller's rules, such as the launcher's
    configuration checks) reports nothing; each layout is asked once.

    Exact for the ``keep`` fastest: a step can take no less than its busiest rank's compute
    (``Shape.bound``), plus its data-parallel traffic and optimizer
    step; the compute alone never falls as the microbatch count grows (the same FLOPs and
    bytes, more operator launches and latencies), so each layout family (all but the
    microbatch count) is bounded by its ``m = 1`` member's compute without simulating a
    pipeline. Families are evaluated in order of that bound, each microbatch count with every
    ZeRO stage, until the bound exceeds the ``keep``-th best time found: nothing left
    unevaluated could enter the first ``keep``. A family is refused whole when
    validation reports a line that reads the same at its smallest and its largest
    microbatch count (lines name the numbers they depend on, so that line holds for every
    count). ``ranked`` holds every evaluated candidate that fits.
    """
    world = cluster.world_size if world is None else world
    model, precision, batch = job.model, job.precision, job.model.batch
    pruned = overflow = invalid = 0
    valid = _Validator(job, validate)
    groups: list[tuple[float, Layout, bool]] = []  # (bound over every m, layout at m = 1)
    for shape in _tp_shapes(world, tp_modes):
        rest = world // shape.tp
        refused = valid.refused_shape(shape, world)
        for cp in divisors(rest):
            for pp in divisors(rest // cp):
                dp = rest // cp // pp
                dense_bound = job.moe is None  # the fit prunes bound the dense model only
                if batch % dp or (dense_bound and _cannot_fit(model, shape, pp, dp * cp, precision, cluster)):
                    pruned += 1  # dp must divide the batch (check says so): skipped here in bulk
                    continue
                for parallel in _expert_variants(
                    _parallel_variants(shape, dp, pp, cp, model.seq, job.recompute), job
                ):
                    for name, v in _schedules(pp, max_chunks):
                        par = dataclasses.replace(parallel, schedule=name, virtual_stages=v, microbatches=1)
                        counts = divisors(batch // dp)
                        if refused or valid.refused_whole(par, counts):
                            invalid += len(counts) * len(recompute)
                            continue
                        for rc in recompute:
                            found = shape_of(
                                dataclasses.replace(par, recompute=rc), model, cluster, precision
                            )
                            if found is not None:
                                groups.append((found.busy, par, rc))
    groups.sort(key=lambda item: item[0])
    fits: list[Candidate] = []
    too_big: list[Candidate] = []
    layouts = 0

    def beaten(bound: float) -> bool:
        return len(fits) >= keep and bound > fits[keep - 1].step_time

    for group_bound, first, rc in groups:
        if beaten(group_bound):
            break
        for m in divisors(batch // first.dp):
            par = dataclasses.replace(first, microbatches=m)
            layouts += 1
            if valid(par):
                invalid += 1
                continue
            run = dataclasses.replace(par, recompute=rc)
            found = shape_of(run, model, cluster, precision)
            if found is None or beaten(found.bound):
                continue
            if job.moe is None and memory_floor(run, found, precision, job.optimizer) > cluster.memory_bytes:
                overflow += 1
                continue
            for stage in range(4):
                for offload in (False, True):
                    layout = dataclasses.replace(run, zero=stage, offload=offload)
                    if beaten(found.bound + sum(overheads(layout, precision, found, cluster))):
                        break  # offload only adds time: it cannot do better either
                    if valid(layout):
                        invalid += 1
                        break
                    est = predict(layout, job, cluster)
                    cand = Candidate(layout, est, est.fits(cluster))
                    if cand.fits:
                        bisect.insort(fits, cand, key=lambda c: (c.step_time, c.estimate.memory.device))
                        break
                    too_big.append(cand)
    too_big.sort(key=lambda c: c.estimate.memory.device)
    return SearchResult(tuple(fits), tuple(too_big), invalid, pruned, layouts, overflow)
