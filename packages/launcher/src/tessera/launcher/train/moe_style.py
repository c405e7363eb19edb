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

The style serves every tp mode as it is (``plan_for_mode`` keeps self-contained styles): under
2D, 2.5D and 3D, where each rank holds a block of the batch and of the hidden, the layer
all-gathers its input whole along the lines of the grid (``ModeSpec.stream_gathers``) and
reduce-scatters its output back, so every rank of the q*q (q*q*d, q**3) tp ranks routes all
the microbatch's tokens as the serial layer does and computes ``hidden / tp`` of every
expert. This costs what 1D sequence parallelism costs the layer: the whole input and output
on every rank, for the layer's time.

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
from tessera.tensor_parallel.modes import mode_spec
from tessera.tensor_parallel.plan import Assignment, Plan, PlanLike, match_pattern, self_contained
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, TPStyle, module_kind, register_style

__all__ = ["MOE_STYLE", "MoEStyle", "check_moe_plan", "split_mixtures"]

# w1 / w3 [n, d, h], w2 [n, h, d], the biases b1 / b3 [n, h]; b2 [n, d] whole (`Experts.keep_hidden`)
_HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}


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
        if ctx.mesh is None:  # 1D without a mesh: the sequence is the only thing split
            split_hidden(module, ctx.group, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim)
            return None
        gathers = mode_spec(ctx.mesh.topology.tp_mode).stream_gathers(
            ctx.mesh, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim
        )
        split_hidden(module, ctx.group, gathers=gathers)
        return None

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        bank, _, weight = param.rpartition(".")
        if bank in ("experts", "shared") and weight in _HIDDEN_DIM:
            return ShardSpec(_HIDDEN_DIM[weight])
        if bank.split(".")[0] in ("experts", "shared") and ".adapters." in param:
            return _adapter_spec(module, param)
        return None  # the router, the shared gate and b2: whole on every tp rank, partial gradients


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


def split_mixtures(plan: PlanLike, model: nn.Module) -> Plan:
    """``plan`` (roles) with every MoE layer of ``model`` that it keeps whole (``replicate``, or
    no entry) given the ``moe`` style instead: what 2D, 2.5D and 3D need, where a mixture kept
    whole would run on one block of the hidden. A ``replicate`` pattern matching other modules
    too keeps them, named one by one. Entries naming a mixture otherwise are left as they are."""
    plan = plan if isinstance(plan, Plan) else Plan.of(plan)
    modules = [name for name, _ in model.named_modules() if name]
    layers = [name for name, m in model.named_modules() if isinstance(m, MoE) and name]
    if not layers:
        return plan
    entries: list[tuple[str, TPStyle]] = []
    for pattern, style in plan.entries:
        hits = [n for n in layers if match_pattern(pattern, n)]
        if style.name != "replicate" or not hits:
            entries.append((pattern, style))
            continue
        entries += [(n, style) for n in modules if match_pattern(pattern, n) and n not in hits]
    named = {n for n in layers for pattern, _ in entries if match_pattern(pattern, n)}
    entries += [(n, MOE_STYLE) for n in layers if n not in named]
    return Plan(tuple(entries), plan.name, plan.supports_sequence_parallel, plan.optional)
