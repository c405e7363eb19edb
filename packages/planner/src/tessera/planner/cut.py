"""The pipeline partitioner's cut of a model, as ``boost()`` makes it: which blocks of
``[embed, *layers, head]`` each stage and rank holds, and their parameter counts.

``partition_by_params`` (``tessera.pipeline``) over one tensor-parallel rank's parameter
counts, the stages placed by the schedule's spec; ``Cut.stages`` lists each stage's kind of
chunk (its layers, and whether it holds the embedding or the head) so that the planner can
time every stage on its own (the embedding and head stages are heavier).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tessera.pipeline import partition_by_params, schedule_spec
from tessera.planner.model import ModelShape, TPShape

__all__ = ["Cut", "Kind", "RankShare", "cut_of"]

Kind = tuple[int, bool, bool]  # a chunk: (transformer layers, holds the embedding, holds the head)


@dataclass(frozen=True, slots=True)
class RankShare:
    """What one pipeline rank holds: parameter elements, its kinds of chunk, its block count
    and its largest block's elements."""

    psi: int
    kinds: tuple[Kind, ...]
    blocks: int
    largest: int
    serial: int  # elements of its blocks in the serial model (before tensor parallelism)


@dataclass(frozen=True, slots=True)
class Cut:
    """The pipeline partitioner's cut of the blocks, by rank (independent of batch and dp)."""

    ranks: tuple[RankShare, ...]
    kinds: frozenset[Kind]
    stages: tuple[Kind, ...]  # by stage index


def cut_of(model: ModelShape, shape: TPShape, pp: int, schedule: str, v: int) -> Cut:
    """Cut ``[embed, *layers, head]`` as ``boost()`` does: ``partition_by_params`` over this
    tensor-parallel rank's parameter counts, stages placed by the schedule's spec (schedules
    that place their stages alike share one cut), ranks balanced when they hold several."""
    return _cut(model, shape, pp, _placement(schedule, pp, v) if pp > 1 else (0,))


@functools.lru_cache(maxsize=1 << 12)
def _placement(schedule: str, pp: int, v: int) -> tuple[int, ...]:
    return tuple(schedule_spec(schedule).stage_to_rank(pp, v))


@functools.lru_cache(maxsize=1 << 14)
def _cut(model: ModelShape, shape: TPShape, pp: int, placement: tuple[int, ...]) -> Cut:
    part = partition_by_params(model.block_params(shape), placement)
    serial = model.block_params()
    last = model.layers + 1

    def kind(stage: int) -> Kind:
        blocks = part.blocks_of_stage(stage)
        return (sum(1 for b in blocks if 0 < b < last), blocks[0] == 0, blocks[-1] == last)

    ranks = []
    for rank in range(pp):
        stages = part.stages_of_rank(rank)
        ranks.append(
            RankShare(
                psi=int(sum(part.costs[s] for s in stages)),
                kinds=tuple(kind(s) for s in stages),
                blocks=sum(len(part.blocks_of_stage(s)) for s in stages),
                largest=int(max(part.block_costs[b] for s in stages for b in part.blocks_of_stage(s))),
                serial=sum(serial[b] for s in stages for b in part.blocks_of_stage(s)),
            )
        )
    by_stage = tuple(kind(s) for s in range(len(placement)))
    return Cut(tuple(ranks), frozenset(k for r in ranks for k in r.kinds), by_stage)
