"""``parallelize``: convert an ordinary model in place by a plan, keeping its weights.

Every check (plan against module names, styles against types, divisibility by tp, tied
weights split consistently) runs before anything is changed or communicated; then the
matched modules are replaced by their parallel versions holding this rank's slice of the
model's own weights, and hooks are installed where a style acts on a module's input or
output. ``parallelize`` itself never communicates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Group, Mesh
from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.tensor_parallel.partition import check_divisible
from tessera.tensor_parallel.plan import (
    COLWISE_STYLES,
    HEAD_ATTRIBUTES,
    Assignment,
    PlanLike,
    Style,
    resolve_plan,
    unplanned_dropouts,
)
from tessera.tensor_parallel.rng import DropoutRNG, ParallelDropout, RNGRegion
from tessera.tensor_parallel.sequence import enter_tp_region, mark_sequence_parallel, scatter_to_sequence

__all__ = ["PER_RANK_ATTRIBUTES", "parallelize", "shard_of"]

log = logging.getLogger(__name__)

# int attributes of an ATTENTION module that count heads or per-rank widths; divided by tp so
# code that reads them (e.g. HF GPT-2's split of its fused q|k|v by ``split_size``) sees its share.
PER_RANK_ATTRIBUTES = (*HEAD_ATTRIBUTES, "split_size", "all_head_size")

_SHARDED = COLWISE_STYLES | {Style.ROWWISE, Style.VOCAB}


def _weight_split(style: Style, module: nn.Module) -> tuple[str, int]:
    """How a style slices the stored weight: (which stored dim, fused sections)."""
    conv = not isinstance(module, nn.Linear | nn.Embedding)  # HF Conv1D stores (in, out)
    if style is Style.ROWWISE:
        return ("dim0" if conv else "dim1", 1)
    return ("dim1" if conv else "dim0", 3 if style is Style.COLWISE_QKV else 1)


def _check_ties(model: nn.Module, assignments: list[Assignment]) -> None:
    """A weight shared by several modules must be split the same way by all of them."""
    by_name = {a.name: a for a in assignments}
    owners: dict[int, list[tuple[str, str, tuple[str, int] | None]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            a = by_name.get(name)
            split = _weight_split(a.style, module) if a is not None and a.style in _SHARDED else None
            owners.setdefault(id(p), []).append((name, pname, split))
    for entries in owners.values():
        if len({split for *_, split in entries}) > 1:
            desc = ", ".join(
                f"{n}.{pn} ({'kept whole' if s is None else f'split {s[0]}'})" for n, pn, s in entries
            )
            raise ValueError(f"a tied parameter would be split inconsistently: {desc}")


@dataclass
class _Converter:
    model: nn.Module
    group: Group
    tp: int
    sequence_parallel: bool
    seq_dim: int
    rng: DropoutRNG
    shared: dict[tuple[int, str, int], nn.Parameter] = field(default_factory=dict)

    def replace(self, name: str, new: nn.Module, old: nn.Module, split: tuple[str, int]) -> None:
        for pname in ("weight", "bias"):
            before, after = getattr(old, pname, None), getattr(new, pname, None)
            if isinstance(before, nn.Parameter) and isinstance(after, nn.Parameter):
                key = (id(before), *split) if pname == "weight" else (id(before), "bias", split[1])
                if key in self.shared:
                    setattr(new, pname, self.shared[key])
                else:
                    after.requires_grad_(before.requires_grad)
                    self.shared[key] = after
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, new)

    def apply(self, a: Assignment) -> None:
        module = self.model.get_submodule(a.name)
        sp, seq_dim, group = self.sequence_parallel, self.seq_dim, self.group
        if a.style in COLWISE_STYLES:
            new: nn.Module = ColumnParallelLinear.from_dense(
                module,
                group=group,
                gather_output=a.style is Style.COLWISE_GATHER,
                sequence_parallel=sp,
                seq_dim=seq_dim,
                enter_region=a.enter_region,
                sections=3 if a.style is Style.COLWISE_QKV else 1,
            )
            self.replace(a.name, new, module, _weight_split(a.style, module))
        elif a.style is Style.ROWWISE:
            new = RowParallelLinear.from_dense(
                module, group=group, input_is_parallel=True, sequence_parallel=sp, seq_dim=seq_dim
            )
            self.replace(a.name, new, module, _weight_split(a.style, module))
        elif a.style is Style.VOCAB:
            assert isinstance(module, nn.Embedding)
            new = VocabParallelEmbedding.from_embedding(
                module, group=group, sequence_parallel=sp, seq_dim=seq_dim
            )
            self.replace(a.name, new, module, _weight_split(a.style, module))
        elif a.style in (Style.DROPOUT, Style.DROPOUT_SPLIT):
            assert isinstance(module, nn.Dropout)
            split = sp or a.style is Style.DROPOUT_SPLIT
            region = RNGRegion.SPLIT if split else RNGRegion.REPLICATED
            self.replace(a.name, ParallelDropout(module.p, self.rng, region), module, ("none", 1))
        elif a.style is Style.SEQUENCE_NORM:
            if sp:
                for p in module.parameters():
                    mark_sequence_parallel(p)
        elif a.style is Style.SEQUENCE_SPLIT:
            if sp:
                module.register_forward_hook(self._split_output(a.name))
        else:
            self._install_region(a, module)

    def _split_output(self, name: str) -> Callable[[nn.Module, Any, Any], Tensor]:
        group, seq_dim = self.group, self.seq_dim

        def hook(module: nn.Module, args: Any, output: Any) -> Tensor:
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"{name} (sequence_split): expected a Tensor output, got {type(output).__name__}"
                )
            return scatter_to_sequence(output, group, seq_dim=seq_dim)

        return hook

    def _install_region(self, a: Assignment, module: nn.Module) -> None:
        group, sp, seq_dim, rng = self.group, self.sequence_parallel, self.seq_dim, self.rng
        attention = a.style is Style.ATTENTION
        entered: list[bool] = []
        name = a.name

        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if not args or not isinstance(args[0], Tensor):
                raise TypeError(f"{name} ({a.style.value}): the input must be the first positional argument")
            x = enter_tp_region(args[0], group, sequence_parallel=sp, seq_dim=seq_dim)
            fork = attention and mod.training
            if fork:
                rng.enter(RNGRegion.SPLIT)
            entered.append(fork)
            return (x, *args[1:]), kwargs

        def post(mod: nn.Module, args: Any, output: Any) -> None:
            if entered and entered.pop():
                rng.exit()

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, always_call=True)
        if attention:
            for attr in PER_RANK_ATTRIBUTES:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, value // self.tp)


def _check_attributes(model: nn.Module, assignments: list[Assignment], tp: int) -> None:
    for a in assignments:
        if a.style is Style.ATTENTION:
            module = model.get_submodule(a.name)
            for attr in PER_RANK_ATTRIBUTES:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    check_divisible(value, tp, what=attr, where=f"{a.name} (attention)")


def parallelize(
    model: nn.Module,
    *,
    plan: PlanLike,
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
    the sequence (dim ``seq_dim`` of the activations) and ``sync_sequence_parallel_grads``
    must run after each backward. Dropout streams come from ``rng``, or a DropoutRNG seeded
    ``seed`` for this tp rank. Raises ValueError (nothing changed, nothing communicated) if
    the plan does not fit the model or tp; see ``resolve_plan``.
    """
    tp = mesh.size(axis)
    assignments = resolve_plan(model, plan, tp=tp, sequence_parallel=sequence_parallel)
    _check_ties(model, assignments)
    _check_attributes(model, assignments, tp)
    for name in unplanned_dropouts(model, assignments):
        log.warning(
            "parallelize: %s is an nn.Dropout the plan does not cover; it draws from the global RNG", name
        )
    if rng is None:
        rng = DropoutRNG(seed, mesh.coordinate(axis), device=mesh.device)
    converter = _Converter(model, mesh.group(axis), tp, sequence_parallel, seq_dim, rng)
    with torch.no_grad():
        for a in assignments:
            converter.apply(a)
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

    Maps a serial state dict (or serial gradients) onto a rank; no communication.
    """
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
        return module.shard_of(pname, full)
    return full
