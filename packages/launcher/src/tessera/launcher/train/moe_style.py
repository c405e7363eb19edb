"""The ``moe`` tensor-parallel style: a ``tessera.moe.MoE`` layer split inside its experts.

A plan entry ``"layers.*.mlp": "moe"`` makes each matched MoE layer a tp region of its own
(`tessera.moe.split_hidden`): every tp rank routes the same whole tokens (with Megatron
sequence parallelism, the layer all-gathers the sequence on entry and reduce-scatters its
output), keeps ``hidden / tp`` hidden units of every expert and of the shared expert, and
the sum over tp of its share of the output leaves the region. The style is self-contained
(``tensor_parallel.plan.self_contained``): it names the split of the layer's descendants'
parameters (``experts.w1`` / ``w3`` along their hidden dim 2, ``experts.w2`` along dim 1,
the same for ``shared``), and the router and the shared gate, whole on every rank inside
the region, get partial gradients that the engine sums over tp. Low-rank adapters on the
experts (`tessera.moe.adapters`) split along the hidden units with their bank (the up
projections of the ``in`` adapters, the down projections of the ``out`` ones); their other
halves stay whole, with partial gradients, as the router's. With expert parallelism too,
each rank holds its ``experts / ep`` experts, each split over tp.

The other way to run an MoE layer under tensor parallelism is ``replicate`` (the whole
mixture on every tp rank, on the same tokens); it cannot take sequence parallelism, whose
ranks would each route their own slice of the sequence (``check_moe_plan``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from torch import nn

from tessera.moe.layer import MoE, hidden_split_problem, split_hidden
from tessera.tensor_parallel import ShardSpec
from tessera.tensor_parallel.plan import Assignment, self_contained
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, module_kind, register_style

__all__ = ["MOE_STYLE", "MoEStyle", "check_moe_plan"]

_HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}  # w1 / w3 [n, d, h], w2 [n, h, d]


@dataclass(frozen=True, slots=True)
class MoEStyle(BaseStyle):
    """``tessera.moe.MoE`` -> the same layer with its experts' hidden units split (module
    docstring)."""

    role: Role = Role.REGION
    self_contained: bool = True

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        if not isinstance(module, MoE):
            raise ValueError(f"{where}: expected a tessera.moe.MoE, got {module_kind(module)}")
        if module.tp_group is not None:
            raise ValueError(f"{where}: its experts are already split over a tp group")
        problem = hidden_split_problem(module, tp)
        if problem:
            raise ValueError(f"{where}: {problem}")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, MoE)
        if ctx.group is None:  # the default group: parallelize is always given the mesh's own
            raise ValueError(f"{ctx.name} ({self.name}): needs the tp group itself, got the default group")
        split_hidden(module, ctx.group, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim)
        return None

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        bank, _, weight = param.rpartition(".")
        if bank in ("experts", "shared") and weight in _HIDDEN_DIM:
            return ShardSpec(_HIDDEN_DIM[weight])
        if bank.split(".")[0] in ("experts", "shared") and ".adapters." in param:
            return _adapter_spec(module, param)
        return None  # the router and the shared gate: whole on every tp rank


def _adapter_spec(module: nn.Module, param: str) -> ShardSpec | None:
    """An expert adapter's part (``<bank>.adapters.<name>.<key>.down`` or ``.up.<w>``): split
    along the hidden units where the bank's weights are (``ExpertAdapter.keep_hidden``); the
    other part whole, its gradient partial over tp."""
    owner = param.removesuffix(".down") if param.endswith(".down") else param.rpartition(".up.")[0]
    adapter = module.get_submodule(owner)
    site = getattr(adapter, "site", None)
    if param.endswith(".down"):
        return ShardSpec(2) if site == "out" else None
    return ShardSpec(1) if site == "in" else None


MOE_STYLE: Final = register_style(MoEStyle("moe"))


def check_moe_plan(model: nn.Module, assignments: Iterable[Assignment], *, sequence_parallel: bool) -> None:
    """Refuse (ValueError naming the layers) MoE layers that Megatron sequence parallelism
    would hand each tp rank's slice of the sequence: any not converted by a self-contained
    style such as ``moe`` (kept whole, or inside another module's region)."""
    if not sequence_parallel:
        return
    split = {a.name for a in assignments if self_contained(a.style)}
    whole = [name for name, m in model.named_modules() if isinstance(m, MoE) and name not in split]
    if whole:
        raise ValueError(
            f"MoE layers {whole[:4]} would route each tp rank's slice of the sequence on its own under "
            "parallel.sequence_parallel (the capacity and router losses of a slice, not the serial "
            "layer's): give them the plan style 'moe', which splits their experts over tp"
        )
