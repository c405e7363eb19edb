"""`ScheduleSpec`: everything about one pipeline schedule, in one typed object.

A spec holds a schedule's name, its generator (the per-rank compute order), its `Layout`
(where virtual stages live), how many chunks (virtual stages) per rank it uses, and its
rules. Everything else asks the spec: the launcher checks a configuration with `check`
before anything spawns, the partitioner takes ``stage_to_rank`` from it, tests ask it for
chunk counts, and `build` turns it into a `Schedule`. A research user writes a generator,
wraps it in a spec and calls `register_schedule`; nothing in Tessera needs editing.

A generator returns only the *compute* actions (F, B, W, BW) of every rank, in order, given
``p`` ranks, ``m`` microbatches and the rank of every virtual stage (from the spec's layout).
`build` adds the p2p actions (a receive right before the compute that consumes it, a send
right after the compute that produces it; see `_build.with_p2p`), which is deadlock-free
under the runtime's non-blocking sends whenever the compute orders respect the data
dependencies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tessera.pipeline._build import with_p2p
from tessera.pipeline.actions import Action, Schedule
from tessera.pipeline.layout import Layout, stage_to_rank

__all__ = ["Rule", "ScheduleGenerator", "ScheduleSpec"]

ScheduleGenerator = Callable[[int, int, tuple[int, ...]], Sequence[Sequence[Action]]]
"""``(p, m, stage_to_rank) -> compute actions of each rank, in order``; inputs are checked."""

Rule = Callable[[int, int, int], str | None]
"""``(p, m, v) -> None`` if the rule holds, else what is wrong, naming the numbers.

Rules only see counts that passed the common checks (``p >= 1``, ``m >= 1``, a valid ``v``).
"""


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """One pipeline schedule: name, generator, layout, chunks per rank and rules.

    Chunks per rank: ``default_chunks`` when the caller names none; with ``min_chunks=None``
    it is the only count allowed, otherwise any ``v >= min_chunks`` is.
    """

    name: str
    generator: ScheduleGenerator
    layout: Layout = Layout.LOOP
    default_chunks: int = 1
    min_chunks: int | None = None
    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a schedule spec needs a non-empty name")
        low = self.default_chunks if self.min_chunks is None else self.min_chunks
        if not 1 <= low <= self.default_chunks:
            raise ValueError(
                f"{self.name}: needs 1 <= min_chunks <= default_chunks; got "
                f"min_chunks={self.min_chunks}, default_chunks={self.default_chunks}"
            )

    @property
    def fixed_chunks(self) -> bool:
        """True when the schedule always uses ``default_chunks`` chunks per rank."""
        return self.min_chunks is None

    def chunks(self, v: int | None = None) -> int:
        """The chunks per rank for a requested ``v`` (``None``: the default).

        Raises ``ValueError`` naming the values when ``v`` is not allowed.
        """
        problem = self._chunk_problem(v)
        if problem:
            raise ValueError(problem)
        return self.default_chunks if v is None else v

    def check(self, p: int, m: int, v: int | None = None) -> list[str]:
        """Every rule that ``p`` ranks, ``m`` microbatches and ``v`` chunks per rank break.

        One line per broken rule, naming the numbers; empty when `build` would succeed. Pure:
        nothing is built.
        """
        lines = []
        if p < 1:
            lines.append(f"{self.name} needs p >= 1 pipeline ranks; got p={p}")
        if m < 1:
            lines.append(f"{self.name} needs m >= 1 microbatches; got m={m}")
        chunk_problem = self._chunk_problem(v)
        if chunk_problem:
            lines.append(chunk_problem)
        if lines:
            return lines
        chunks = self.default_chunks if v is None else v
        return [line for rule in self.rules if (line := rule(p, m, chunks)) is not None]

    def stage_to_rank(self, p: int, v: int | None = None) -> tuple[int, ...]:
        """The rank of every virtual stage with ``p`` ranks and ``v`` chunks per rank."""
        return stage_to_rank(self.layout, p, self.chunks(v))

    def build(self, p: int, m: int, v: int | None = None) -> Schedule:
        """The schedule for ``p`` ranks, ``m`` microbatches, ``v`` chunks per rank.

        Raises ``ValueError`` with every line of `check` when the numbers break a rule.
        """
        lines = self.check(p, m, v)
        if lines:
            raise ValueError("; ".join(lines))
        ranks = self.stage_to_rank(p, v)
        compute = self.generator(p, m, ranks)
        if len(compute) != p:
            raise ValueError(f"{self.name}'s generator gave {len(compute)} rank orders for p={p}")
        return with_p2p(self.name, m, ranks, compute)

    def _chunk_problem(self, v: int | None) -> str | None:
        if v is None:
            return None
        if self.min_chunks is None and v != self.default_chunks:
            return (
                f"{self.name} always places {self.default_chunks} chunk(s) per rank; got v={v}"
            )
        if self.min_chunks is not None and v < self.min_chunks:
            return f"{self.name} needs v >= {self.min_chunks} chunks per rank; got v={v}"
        return None
