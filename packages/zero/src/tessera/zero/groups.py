"""Which FlatParams a ``ZeroOptimizer`` builds, and over which process group each is sharded.

Every parameter is sharded (and its gradient reduced) over the optimizer's data-parallel
``group``, unless ``sharding`` names another group for it: expert parameters under expert
parallelism live on their ep rank only and are sharded over the expert-data-parallel group,
the ranks that hold the same experts. A FlatParam holds parameters of one optimizer group
and one process group; its gradient is summed over its own group and, like every other,
divided by the optimizer's ``average_over`` (so it is the gradient of the same mean loss).

Stages 0-2 bucket each (optimizer group, process group) pair's parameters, in reverse order
of ``named`` (the order backward finishes them); stage 3 makes one FlatParam per unit,
optimizer group and process group. Without ``sharding`` the buffers are exactly those of a
single group. Frozen parameters (``requires_grad=False``) form one more group, index
``n_groups``, whose FlatParams are sharded and gathered like the others but never reduced
nor stepped.

The gradient norm counts every element once over the data-parallel group: a shard held by
one rank of ``group`` counts fully; at stage 0 a flat buffer is whole on each of the
``n`` ranks of its own group, so each copy counts ``1/n`` (``norm_weights``). Parameters
of another group differ between the ranks outside it (different experts), so they are
summed over ``group`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set

from torch import nn

from tessera.comm import Group, group_size
from tessera.zero.clip import shard_weights
from tessera.zero.flat import bucketize
from tessera.zero.flat_param import FlatParam
from tessera.zero.units import assign_params

__all__ = ["FlatMaker", "build_flats", "mixed_groups", "norm_weights"]

FlatMaker = Callable[[list[tuple[str, nn.Parameter]], int, bool, Group], FlatParam]
"""Makes one FlatParam from ``(name, param)`` pairs, its optimizer group, whether it is
sharded (stage 3) and the process group it is sharded over."""

Pairs = list[tuple[str, nn.Parameter]]


def _by_group(
    pairs: Pairs, sharding: Mapping[nn.Parameter, Group], group: Group, apart: Set[int] = frozenset()
) -> list[tuple[Group, Pairs]]:
    """``pairs`` split by process group, the default ``group`` first, then the others in
    order of first appearance, and those in ``apart`` (by ``id``) from the others of their
    group; each keeps the order of ``pairs``."""
    split: dict[tuple[int, bool], tuple[Group, Pairs]] = {(id(group), False): (group, [])}
    for name, p in pairs:
        g = sharding.get(p, group)
        split.setdefault((id(g), id(p) in apart), (g, []))[1].append((name, p))
    return [(g, mine) for g, mine in split.values() if mine]


def build_flats(
    model: nn.Module,
    named: Sequence[tuple[str, nn.Parameter]],
    group_of: Mapping[int, int],
    *,
    stage: int,
    n_groups: int,
    bucket_bytes: int,
    itemsize: int,
    units: Sequence[nn.Module],
    group: Group,
    sharding: Mapping[nn.Parameter, Group],
    make: FlatMaker,
    apart: Set[int] = frozenset(),
) -> tuple[list[FlatParam], list[tuple[nn.Module, list[FlatParam]]]]:
    """The FlatParams (and, at stage 3, each unit's) of ``named`` (``group_of``: a
    parameter's optimizer group by ``id``, ``n_groups`` for a frozen one); the parameters in
    ``apart`` (by ``id``: those computed in another dtype) in FlatParams of their own."""
    flats: list[FlatParam] = []
    unit_list: list[tuple[nn.Module, list[FlatParam]]] = []
    if stage in (0, 1, 2):
        for gi in range(n_groups + 1):
            mine = [(n, p) for n, p in reversed(named) if group_of[id(p)] == gi]
            for g, pairs in _by_group(mine, sharding, group, apart):
                sizes = [p.numel() * itemsize for _, p in pairs]
                for bucket in bucketize(sizes, bucket_bytes):
                    flats.append(make([pairs[i] for i in reversed(bucket)], gi, False, g))
        return flats, unit_list
    for unit, pairs in assign_params(model, list(units)):
        unit_flats = []
        for gi in range(n_groups + 1):
            mine = [(n, p) for n, p in pairs if group_of[id(p)] == gi]
            for g, sub in _by_group(mine, sharding, group, apart):
                unit_flats.append(make(sub, gi, True, g))
        unit_list.append((unit, unit_flats))
        flats.extend(unit_flats)
    return flats, unit_list


def mixed_groups(flats: Sequence[FlatParam], group: Group) -> bool:
    """Whether some FlatParam is sharded over another group than ``group``."""
    return any(f.group is not group for f in flats)


def norm_weights(
    flats: Sequence[FlatParam],
    group: Group,
    *,
    stage: int,
    replication: Mapping[nn.Parameter, int] | None,
) -> list[list[tuple[int, int, float]] | None]:
    """Per FlatParam, the pieces of this rank's shard counted with a weight other than 1 in
    the squared gradient norm summed over ``group`` (see the module docstring): ``1 / n`` for
    the ``n`` model-parallel copies of a replicated parameter (``replication``), times
    ``1 / size`` of the FlatParam's own group at stage 0 when the groups are mixed."""
    copies = dict(replication or {})
    mixed = stage == 0 and mixed_groups(flats, group)
    out: list[list[tuple[int, int, float]] | None] = []
    for f in flats:
        whole = 1.0 / group_size(f.group) if mixed else 1.0
        weights = [whole / copies.get(p, 1) for p in f.params]
        out.append(shard_weights(f.layout, f.shard_rank, weights) if any(w != 1.0 for w in weights) else None)
    return out
