"""Enumerate every configuration the launcher accepts for a world size, predict each, rank.

The search space is every split of the world into ``dp * pp * tp * sp`` with every
tensor-parallel mode (1D with and without Megatron sequence parallelism; 2D, 2.5D at every
depth, 3D where tp is a square or cube), context parallelism (ring or Ulysses), every
registered pipeline schedule (interleaved ones at 2..``max_chunks`` chunks per rank), every
microbatch count that divides the batch, every ZeRO stage, with and without offload. Each
candidate is a launcher `Config` (the base configuration with its ``[parallel]`` and
``[zero]`` replaced) and is kept only if ``Config.validate()`` accepts it: the launcher's
rules, not a copy.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tessera.launcher.config import Config, ParallelConfig, ZeroConfig
from tessera.launcher.plan.cluster import Cluster
from tessera.launcher.plan.estimate import Estimate, estimate, memory_floor, overheads, shape_of
from tessera.launcher.plan.memory import DTYPE_BYTES
from tessera.launcher.plan.model import ModelShape, TPShape
from tessera.pipeline import SCHEDULES

__all__ = ["Candidate", "SearchResult", "divisors", "search"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One valid configuration and its prediction."""

    config: Config
    estimate: Estimate
    fits: bool
    recompute: bool = False

    @property
    def step_time(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.estimate.time.total

    def label(self) -> str:
        """A short description of the degrees, schedule and ZeRO stage."""
        p, z = self.config.parallel, self.config.zero
        tp = (
            f"tp{p.tp}"
            + ("" if p.tp_mode == "1d" else f"/{p.tp_mode}")
            + (f"d{p.tp_depth}" if p.tp_depth > 1 else "")
        )
        tp += "+sp" if p.sequence_parallel else ""
        parts = [f"dp{p.dp}", f"pp{p.pp}", tp]
        if p.sp > 1:
            parts.append(f"cp{p.sp}/{p.sp_mode}")
        if p.pp > 1:
            parts.append(p.schedule + (f"x{p.virtual_stages}" if p.virtual_stages > 1 else ""))
        parts.append(f"m{p.microbatches}")
        parts.append(f"z{z.stage}" + ("+off" if z.offload else ""))
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class SearchResult:
    """Ranked candidates that fit (fastest first), the ones that do not, and counts."""

    ranked: tuple[Candidate, ...]
    too_big: tuple[Candidate, ...]
    invalid: int  # candidates Config.validate() refused
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
        q2 = math.isqrt(tp)
        if "2d" in modes and q2 * q2 == tp:
            yield TPShape("2d", tp)
        if "2.5d" in modes:
            for depth in divisors(tp)[1:]:
                q = math.isqrt(tp // depth)
                if q > 1 and q * q == tp // depth:
                    yield TPShape("2.5d", tp, depth)
        q3 = round(tp ** (1 / 3))
        if "3d" in modes and q3**3 == tp:
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


def _parallel_variants(shape: TPShape, dp: int, pp: int, sp: int, seq_len: int) -> Iterator[ParallelConfig]:
    base = ParallelConfig(dp=dp, pp=pp, tp=shape.tp, sp=sp, tp_mode=shape.mode, tp_depth=shape.depth)
    seq_par = (False, True) if shape.mode == "1d" and shape.tp > 1 else (False,)
    modes = ("ring", "ulysses") if sp > 1 else ("ring",)
    for sequence_parallel in seq_par:
        for sp_mode in modes:
            layout = "contiguous"
            if sp > 1 and seq_len % (2 * sp * (shape.tp if sequence_parallel else 1)) == 0:
                layout = "zigzag"
            yield dataclasses.replace(
                base, sequence_parallel=sequence_parallel, sp_mode=sp_mode, sp_layout=layout
            )


def _cannot_fit(model: ModelShape, shape: TPShape, pp: int, n: int, precision: str, cluster: Cluster) -> bool:
    """Even fully sharded (ZeRO-3 with offload), the fullest pipeline rank's device-resident
    model state exceeds a device: ``c psi / n`` unpipelined; under a pipeline the engine holds
    full parameters and gradients until the step at every stage (``accumulating()``)."""
    psi = sum(model.block_params(shape)) / pp  # the fullest rank holds at least the mean
    c = DTYPE_BYTES[precision]
    least = c * psi / n if pp == 1 else 2 * c * psi
    return least > cluster.memory_bytes


class _Validator:
    """``Config.validate()`` of the configurations one search builds, each asked once (the
    search asks again for the same configuration: a family's first microbatch count, its
    ZeRO stage 0 without offload)."""

    def __init__(self, base: Config) -> None:
        self.base = base
        self.seen: dict[tuple[ParallelConfig, ZeroConfig, bool], tuple[str, ...]] = {}

    def __call__(
        self, parallel: ParallelConfig, zero: ZeroConfig | None = None, recompute: bool | None = None
    ) -> tuple[str, ...]:
        """The lines of ``base`` with ``parallel``, ``zero`` (default: ``ZeroConfig()``) and
        activation checkpointing ``recompute`` (default: the base's)."""
        train = self.base.train
        if recompute is not None and recompute != train.activation_checkpointing:
            train = dataclasses.replace(train, activation_checkpointing=recompute)
        zero = ZeroConfig() if zero is None else zero
        key = (parallel, zero, train.activation_checkpointing)
        lines = self.seen.get(key)
        if lines is None:
            config = dataclasses.replace(self.base, parallel=parallel, zero=zero, train=train)
            lines = self.seen[key] = tuple(config.validate())
        return lines

    def refused_shape(self, shape: TPShape, world: int) -> bool:
        """Whether validation refuses every configuration of a tensor-parallel shape: a line
        reported alike with the rest of the world all data-, all context- and all
        pipeline-parallel (the launcher's messages name the numbers they depend on, so that
        line depends on the shape and the model alone: heads or widths that do not split)."""
        rest = world // shape.tp
        if rest == 1:
            return False
        common: set[str] | None = None
        for dp, sp, pp in ((rest, 1, 1), (1, rest, 1), (1, 1, rest)):
            par = ParallelConfig(
                dp=dp, pp=pp, tp=shape.tp, sp=sp, tp_mode=shape.mode, tp_depth=shape.depth, microbatches=1
            )
            lines = set(self(par))
            common = lines if common is None else common & lines
            if not common:
                return False
        return True

    def refused_whole(self, parallel: ParallelConfig, counts: Sequence[int]) -> bool:
        """Whether validation refuses the family for a reason independent of the microbatch
        count: a line reported alike at its smallest and its largest count."""
        first = self(dataclasses.replace(parallel, microbatches=counts[0]))
        if not first:
            return False
        return bool(set(first) & set(self(dataclasses.replace(parallel, microbatches=counts[-1]))))


def search(
    base: Config,
    cluster: Cluster,
    *,
    world: int | None = None,
    model: ModelShape | None = None,
    tp_modes: Sequence[str] = ("1d", "2d", "2.5d", "3d"),
    max_chunks: int = 4,
    recompute: Sequence[bool] = (False,),
    keep: int = 20,
) -> SearchResult:
    """Every valid configuration of ``base``'s model on ``world`` ranks of ``cluster``
    (default: all its devices), predicted and ranked by step time among those that fit.

    Exact for the ``keep`` fastest: a step can take no less than its busiest rank's compute
    plus the pipeline's fill (``Shape.bound``), plus its data-parallel traffic and optimizer
    step; the compute alone never falls as the microbatch count grows (the same FLOPs and
    bytes, more operator launches and latencies), so each layout family (all but the
    microbatch count) is bounded by its ``m = 1`` member's compute without simulating a
    pipeline. Families are evaluated in order of that bound, each microbatch count with every
    ZeRO stage, until the bound exceeds the ``keep``-th best time found: nothing left
    unevaluated could enter the first ``keep``. A family is refused whole when
    ``Config.validate()`` reports a line that reads the same at its smallest and its largest
    microbatch count (the launcher's messages name the numbers they depend on, so that
    line holds for every count). ``ranked`` holds every evaluated candidate that fits.
    """
    world = cluster.world_size if world is None else world
    model = ModelShape.from_config(base) if model is None else model
    precision, batch = base.train.precision, base.data.batch_size
    pruned = overflow = invalid = 0
    valid = _Validator(base)
    groups: list[tuple[float, ParallelConfig, bool]] = []  # (bound over every m, layout at m = 1)
    for shape in _tp_shapes(world, tp_modes):
        rest = world // shape.tp
        refused = valid.refused_shape(shape, world)
        for sp in divisors(rest):
            for pp in divisors(rest // sp):
                dp = rest // sp // pp
                if batch % dp or _cannot_fit(model, shape, pp, dp * sp, precision, cluster):
                    pruned += 1  # dp must divide the batch (validation says so): skipped here in bulk
                    continue
                for parallel in _parallel_variants(shape, dp, pp, sp, model.seq):
                    for name, v in _schedules(pp, max_chunks):
                        par = dataclasses.replace(parallel, schedule=name, virtual_stages=v, microbatches=1)
                        counts = divisors(batch // dp)
                        if refused or valid.refused_whole(par, counts):
                            invalid += len(counts) * len(recompute)
                            continue
                        for rc in recompute:
                            found = shape_of(par, model, cluster, precision, rc)
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
            found = shape_of(par, model, cluster, precision, rc)
            if found is None or beaten(found.bound):
                continue
            if memory_floor(par, found, precision, base.optim.name) > cluster.memory_bytes:
                overflow += 1
                continue
            for stage in range(4):
                for offload in (False, True):
                    train = dataclasses.replace(base.train, activation_checkpointing=rc)
                    zero = ZeroConfig(stage, offload)
                    config = dataclasses.replace(base, parallel=par, zero=zero, train=train)
                    if beaten(found.bound + sum(overheads(config, found, cluster))):
                        break  # offload only adds time: it cannot do better either
                    if valid(par, zero, rc):
                        invalid += 1
                        break
                    est = estimate(config, model, cluster, recompute=rc)
                    cand = Candidate(config, est, est.fits(cluster), rc)
                    if cand.fits:
                        bisect.insort(fits, cand, key=lambda c: (c.step_time, c.estimate.memory.device))
                        break
                    too_big.append(cand)
    too_big.sort(key=lambda c: c.estimate.memory.device)
    return SearchResult(tuple(fits), tuple(too_big), invalid, pruned, layouts, overflow)
