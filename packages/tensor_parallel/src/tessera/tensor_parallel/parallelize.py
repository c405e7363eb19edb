"""``parallelize``: convert an ordinary model in place by a plan, keeping its weights.

Every check (plan against module names, styles against types, divisibility by tp, tied
weights split consistently) runs before anything is changed or communicated; then the
matched modules are replaced by their parallel versions holding this rank's slice of the
model's own weights, and hooks are installed where a style acts on a module's input or
output. ``parallelize`` itself never communicates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tessera.comm import Group, Mesh, TPMode
from tessera.tensor_parallel.coverage import Coverage, cover
from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.plan import (
    Assignment,
    PlanLike,
    ResolvedPlan,
    assigned_spec,
    resolve,
    self_contained,
    unplanned_dropouts,
)
from tessera.tensor_parallel.probe import probe_attention
from tessera.tensor_parallel.probe_modules import probe_modules
from tessera.tensor_parallel.rng import DropoutRNG
from tessera.tensor_parallel.sequence import mark_sequence_parallel
from tessera.tensor_parallel.style import ApplyContext

__all__ = ["coverage", "parallelize", "shard_of", "shard_specs"]

log = logging.getLogger(__name__)

_SPECS_ATTRIBUTE = "_tessera_shard_specs"
_COVERAGE_ATTRIBUTE = "_tessera_coverage"


def _check_ties(model: nn.Module, assignments: list[Assignment]) -> None:
    """A weight shared by several modules must be split the same way by all of them."""
    by_name = {a.name: a for a in assignments}
    owners: dict[int, list[tuple[str, str, ShardSpec | None]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            split = assigned_spec(by_name, model, f"{name}.{pname}" if name else pname)[1]
            owners.setdefault(id(p), []).append((name, pname, split))
    for entries in owners.values():
        if len({split for *_, split in entries}) > 1:
            desc = ", ".join(
                f"{n}.{pn} ({'kept whole' if s is None else f'split {s}'})" for n, pn, s in entries
            )
            raise ValueError(f"a tied parameter would be split inconsistently: {desc}")


def _record_specs(model: nn.Module, assignments: list[Assignment]) -> dict[str, ShardSpec]:
    """The shard spec of every parameter the plan splits, by its serial name (tied aliases too;
    a self-contained region's descendants' too)."""
    out = {}
    for a in assignments:
        module = model.get_submodule(a.name)
        for pname, _ in module.named_parameters(recurse=self_contained(a.style)):
            spec = a.style.shard_spec(module, pname)
            if spec is not None:
                out[f"{a.name}.{pname}"] = spec
    return out


@dataclass
class _Converter:
    model: nn.Module
    group: Group
    tp: int
    sequence_parallel: bool
    seq_dim: int
    rng: DropoutRNG
    mesh: Mesh | None = None
    shared: dict[tuple[int, ShardSpec | None], nn.Parameter] = field(default_factory=dict)

    def replace(self, a: Assignment, new: nn.Module, old: nn.Module) -> None:
        """Put ``new`` in ``old``'s place; a parameter tied in the serial model stays tied."""
        for pname, before in old.named_parameters(recurse=False):
            after = getattr(new, pname, None)
            if isinstance(after, nn.Parameter):
                key = (id(before), a.style.shard_spec(old, pname))
                if key in self.shared:
                    setattr(new, pname, self.shared[key])
                else:
                    after.requires_grad_(before.requires_grad)
                    self.shared[key] = after
        parent_name, _, child = a.name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, new)

    def apply(self, a: Assignment) -> None:
        module = self.model.get_submodule(a.name)
        ctx = ApplyContext(
            a.name,
            self.group,
            self.tp,
            self.sequence_parallel,
            self.seq_dim,
            self.rng,
            a.enter_region,
            self.mesh,
        )
        new = a.style.apply(module, ctx)
        if new is not None:
            self.replace(a, new, module)


def parallelize(
    model: nn.Module,
    *,
    plan: PlanLike | ResolvedPlan,
    mesh: Mesh,
    sequence_parallel: bool = False,
    seq_dim: int = -2,
    seed: int = 0,
    rng: DropoutRNG | None = None,
    axis: str = "tp",
) -> nn.Module:
    """Make ``model`` tensor-parallel over ``mesh``'s ``axis`` group by ``plan``; return it.

    Modules are replaced in place by parallel ones holding this rank's slice of their own
    weights (tied weights stay tied), so build the optimizer afterwards. With
    ``sequence_parallel`` the residual stream between sublayers holds this rank's slice of
    the sequence (dim ``seq_dim`` of the activations). Every parameter kept whole whose
    gradient is a partial sum per rank (``coverage``: norms in the sequence-parallel stream,
    anything inside a tp region, every whole parameter in 2D/2.5D/3D) is tagged, whether or
    not the plan names it; ``sync_sequence_parallel_grads`` sums exactly those and must run
    after each backward when ``coverage(model).partial`` is not empty. Dropout streams come
    from ``rng``, or a DropoutRNG seeded ``seed`` for this tp rank. Raises ValueError
    (nothing changed, nothing communicated) if the plan does not fit the model or tp; see
    ``resolve_plan`` (``plan`` may be resolved already: `ResolvedPlan`, ``resolve``), or if an
    attention module's shards would not add up to it
    (``probe.probe_attention``), or if a module whose parameters a style splits would not be
    computed by its shards (a scale or offset its forward adds: ``probe_modules``; one INFO line
    says how many were probed). ``shard_specs(model)`` then says how each split parameter
    maps to its shards.
    """
    tp = mesh.size(axis)
    if not isinstance(plan, ResolvedPlan):
        plan = resolve(model, plan, tp=tp, sequence_parallel=sequence_parallel)
    elif (plan.tp, plan.sequence_parallel) != (tp, sequence_parallel):
        raise ValueError(
            f"plan {plan.plan.name!r} was resolved for tp={plan.tp}, "
            f"sequence_parallel={plan.sequence_parallel}; parallelize got tp={tp}, "
            f"sequence_parallel={sequence_parallel}"
        )
    assignments = list(plan.assignments)
    _check_ties(model, assignments)
    if axis == "tp" and mesh.topology.tp_mode is TPMode.ONE_D:
        probe_attention(model, assignments, tp=tp)
    probe_modules(model, assignments, tp=tp)
    for name in unplanned_dropouts(model, assignments):
        log.warning(
            "parallelize: %s is an nn.Dropout the plan does not cover; it draws from the global RNG", name
        )
    if rng is None:
        rng = DropoutRNG(seed, mesh.coordinate(axis), device=mesh.device)
    specs = _record_specs(model, assignments)
    nd = axis == "tp" and mesh.topology.tp_mode is not TPMode.ONE_D
    covered = cover(model, assignments, sequence_parallel=sequence_parallel, every_element_once=nd)
    converter = _Converter(model, mesh.group(axis), tp, sequence_parallel, seq_dim, rng, mesh)
    with torch.no_grad():
        for a in assignments:
            converter.apply(a)
    named = dict(model.named_parameters())
    for name in covered.partial:
        mark_sequence_parallel(named[name])
    if covered.undeclared:
        log.warning(
            "parallelize: %d whole parameters the plan does not name get partial gradients, summed "
            "over tp after each backward (sync_sequence_parallel_grads): %s",
            len(covered.undeclared),
            covered.describe_undeclared(),
        )
    setattr(model, _SPECS_ATTRIBUTE, specs)
    setattr(model, _COVERAGE_ATTRIBUTE, covered)
    log.info(
        "parallelize: %d modules of %s over tp=%d (sequence_parallel=%s)",
        len(assignments),
        type(model).__name__,
        tp,
        sequence_parallel,
    )
    return model


def shard_of(model: nn.Module, name: str, full: Tensor) -> Tensor:
    """This rank's part of the serial model's tensor ``full`` for parameter ``name`` of a
    parallelized ``model``: the slice a parallel layer holds, the whole tensor otherwise.

    Maps a serial state dict (or serial gradients) onto a rank, in the serial layout: a
    Hugging Face ``Conv1D`` weight is given (in, out) as the serial model holds it and comes
    back as the parallel layer stores it (``ShardSpec.transposed``); no communication.
    """
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
        spec = shard_specs(model).get(name)
        return module.shard_of(pname, full.t() if spec is not None and spec.transposed else full)
    return full


def shard_specs(model: nn.Module) -> Mapping[str, ShardSpec]:
    """How ``parallelize`` split ``model``'s parameters: serial parameter name -> its
    ``ShardSpec`` (tied aliases under each name); a parameter not listed is whole on every
    rank. Empty for a model ``parallelize`` has not converted."""
    specs: dict[str, ShardSpec] = getattr(model, _SPECS_ATTRIBUTE, {})
    return dict(specs)


def coverage(model: nn.Module) -> Coverage:
    """How ``parallelize`` accounted for every parameter of ``model`` (``coverage.Coverage``:
    split, whole with a complete gradient, whole with a partial one); ValueError for a model
    ``parallelize`` has not converted."""
    covered = getattr(model, _COVERAGE_ATTRIBUTE, None)
    if not isinstance(covered, Coverage):
        raise ValueError(f"{type(model).__name__} was not converted by parallelize: no coverage")
    return covered
