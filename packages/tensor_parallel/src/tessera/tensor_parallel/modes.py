"""Tensor-parallel modes: each turns a plan of roles into its own plan.

A plan is written once, in roles (the 1D style names ``colwise``, ``rowwise``, ``vocab``,
``attention``, ``region``, ``sequence_norm``, ``sequence_split``, ``dropout``,
``dropout_split``, ``colwise_qkv``, ``colwise_qkv_heads``, ``colwise_gate_up``, and the roles
of ``roles``: ``head``, ``norm``, ``embedding``, ``replicate``). Each mode (1D, 2D, 2.5D, 3D)
is a registered ``ModeSpec`` keyed by ``tessera.comm.TPMode`` holding one table, role name ->
its style;
``plan_for_mode(plan, mode, model)`` asks it. 1D is the identity (the roles are 1D styles).
In 2D / 2.5D / 3D:

| role | becomes |
| --- | --- |
| ``colwise``, ``rowwise`` | the mode's linear (3D: stream to branch, branch to stream); Linear or HF Conv1D |
| ``colwise_qkv`` | the same, its q, k, v parts reordered so each rank's block holds whole heads of each |
| ``colwise_qkv_heads`` | as ``colwise_qkv`` (``attention`` refuses a q, k, v of grouped KV heads) |
| ``colwise_gate_up`` | the same, its gate and up halves reordered so each rank's block holds both |
| ``vocab`` | the mode's vocabulary-split embedding |
| ``head`` | the mode's classifier; in 2D / 2.5D, tied to the ``vocab`` embedding, ``TiedHead2D`` |
| ``embedding``, ``sequence_split`` | the mode's hidden-split embedding (learned positions) |
| ``norm``, ``sequence_norm`` | ``NormND``: LayerNorm exact, any other norm on the gathered hidden |
| ``attention`` | ``AttentionND``: unchanged on its local block (q divides heads and KV heads) |
| ``region``, ``replicate`` | kept as they are |
| ``dropout``, ``dropout_split`` | ``dropout_split`` (every activation element lives on one rank) |
| ``*_whole``, ``sequence_end`` | as ``vocab``, ``embedding``, ``dropout``, ``head``; ``norm`` |
| ``sequence_start`` | kept as it is |

``colwise_gather`` is refused; a style the table does not know is a ValueError naming the
plan entry, the role and the mode, and so is a role its style then finds it cannot serve
(from the style's check, before anything changes). A style of the mode's own (named
``2d_...``, ``2.5d_...``, ``3d_...``) is kept, so mode-specific plans pass unchanged.

Given the model, a ``colwise`` entry outside every ``region`` / ``attention`` module on a
layer whose out_features is the vocabulary of a ``vocab`` embedding is read as ``head``, so
1D plans that wrote their LM head ``colwise`` work in every mode; and a head whose weight is
the ``vocab`` embedding's (tied) gets the tied classifier where the mode needs one (3D's
classifier and vocab embedding already share one cut). Without the model a tied head is
refused by ``parallelize`` (a tied parameter split two ways). Given the model, a module
holding parameters that no entry names is refused (ValueError naming it): every activation
is split in these modes, so an unplanned norm would normalise one block. ``depth`` binds 2.5D's depth so
that every size is checked before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from tessera.comm import Group, Mesh, TPMode
from tessera.tensor_parallel.adapted import has_adapters
from tessera.tensor_parallel.layers import dense_weights, is_dense
from tessera.tensor_parallel.mode_objectives import (
    ModeObjective,
    objective_1d,
    objective_2d,
    objective_2p5d,
    objective_3d,
)
from tessera.tensor_parallel.nd_styles import (
    AttentionND,
    DenseND,
    Geometry,
    KeepND,
    NormND,
    TiedHead2D,
    _hidden_2d,
    _with_depth,
)
from tessera.tensor_parallel.plan import Plan, PlanLike, match_pattern, self_contained
from tessera.tensor_parallel.roles import Replicate
from tessera.tensor_parallel.style import TPStyle
from tessera.tensor_parallel.styles import Style
from tessera.tensor_parallel.three_d.cube import Cube3D
from tessera.tensor_parallel.three_d.styles import Styles3D
from tessera.tensor_parallel.two_d.grid import Grid2D
from tessera.tensor_parallel.two_d.styles import Styles2D
from tessera.tensor_parallel.two_p5_d.grid import Grid2p5D
from tessera.tensor_parallel.two_p5_d.styles import Styles2p5D

__all__ = ["ModeSpec", "StreamGather", "mode_spec", "plan_for_mode", "register_mode", "registered_modes"]

StreamGather = tuple[int, Group]
"""An all-gather of the residual stream: (its dim, the group whose ranks hold its blocks in
group-rank order)."""

_HEAD_LIKE = ("head", "colwise", "colwise_whole")
_VOCAB_LIKE = ("vocab", "vocab_whole")
_REGION_LIKE = ("region", "attention")


@dataclass(frozen=True, slots=True)
class ModeSpec:
    """One tensor-parallel mode: ``roles`` maps a role name to the mode's style, ``refused``
    a role to why the mode cannot serve it; ``native`` is the prefix of the mode's own style
    names (kept as they are); ``tied_head`` the head style when its weight is the vocab
    embedding's (None: ``roles['head']`` serves tied heads too). ``identity``: the roles are
    this mode's styles (1D). ``objective(mesh)``: this rank's share of a batch and the mode's
    exact summed cross-entropy (`ModeObjective`), so that a trainer asks the mode what to feed
    and how to score, instead of branching on it."""

    mode: TPMode
    objective: Callable[[Mesh], ModeObjective]
    roles: Mapping[str, TPStyle] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    native: str | None = None
    tied_head: TPStyle | None = None
    identity: bool = False
    blocks: Callable[[Mesh], tuple[StreamGather, ...]] | None = None

    def stream_gathers(
        self, mesh: Mesh, *, sequence_parallel: bool = False, seq_dim: int = -2
    ) -> tuple[StreamGather, ...]:
        """The all-gathers (dim, group), in order, that make this rank's part of the residual
        stream ``[batch, ..., hidden]`` whole on every tp rank; reduce-scatters in the reverse
        order make a whole result this rank's part again, summed over tp. 1D: none (every rank
        holds the whole stream), or the sequence over tp under sequence parallelism; 2D: the
        hidden over the row, then the batch over the column; 2.5D: then over the depth too; 3D:
        the hidden over ``tp_output``, the batch over ``tp_input`` then ``tp_weight``. What a
        module needs when it must see whole tokens inside a mode that splits them (a mixture of
        experts, whose routing and capacity are those of all the batch's tokens)."""
        if self.blocks is None:
            return ((seq_dim, mesh.group("tp")),) if sequence_parallel else ()
        return self.blocks(mesh)

    @property
    def whole_rows(self) -> bool:
        """Every tp rank sees a microbatch's whole rows (``TPMode.whole_rows``)."""
        return self.mode.whole_rows

    def translate(self, plan: PlanLike, model: nn.Module | None = None, *, depth: int | None = None) -> Plan:
        """``plan`` (roles) as this mode's plan (see the module docstring); pure."""
        plan = plan if isinstance(plan, Plan) else Plan.of(plan)
        if self.identity:
            return plan
        heads = self._heads(plan, model)
        if model is not None:
            self._check_covered(plan, model)
        entries: list[tuple[str, TPStyle]] = []
        for pattern, style in plan.entries:
            role = style.name
            if pattern in heads:
                new = heads[pattern]
            elif self_contained(style):  # it reads the mode's layout from the mesh itself
                new = style
            elif role in self.roles:
                new = self.roles[role]
            elif role in self.refused:
                raise ValueError(
                    f"plan entry {pattern!r}: role {role!r} cannot be served by tp mode {self.mode.value}: "
                    f"{self.refused[role]}"
                )
            elif self.native is not None and role.startswith(self.native):
                new = style
            else:
                raise ValueError(
                    f"plan entry {pattern!r}: role {role!r} has no form in tp mode {self.mode.value} "
                    f"(its roles: {', '.join(self.roles)})"
                )
            entries.append((pattern, new if depth is None else _with_depth(new, depth)))
        return Plan(
            tuple(entries),
            f"{plan.name}@{self.mode.value}",
            supports_sequence_parallel=False,
            optional=plan.optional,
        )

    def _check_covered(self, plan: Plan, model: nn.Module) -> None:
        """Every module owning parameters has a plan entry: in this mode each rank holds a
        block of every activation, so an unplanned norm would normalise one block (wrong)."""
        patterns = [p for p, _ in plan.entries]
        whole = [p for p, style in plan.entries if self_contained(style)]
        adapted: list[str] = []  # planned layers carrying adapters: their parts follow the entry
        for name, module in model.named_modules():
            if any(name.startswith(a + ".") for a in adapted):
                continue
            if (has_adapters(module) and any(match_pattern(p, name) for p in patterns)) or any(
                match_pattern(p, name) for p in whole
            ):  # a self-contained region says how its whole subtree is split
                adapted.append(name)
                continue
            if any(True for _ in module.parameters(recurse=False)) and not any(
                match_pattern(p, name) for p in patterns
            ):
                raise ValueError(
                    f"{name or type(model).__name__} ({type(module).__qualname__}) holds parameters but no "
                    f"plan entry names it: in tp mode {self.mode.value} every activation is split, so "
                    "give it a role (a norm: 'norm'; a layer: 'colwise'/'rowwise'; kept whole: 'replicate')"
                )

    def _heads(self, plan: Plan, model: nn.Module | None) -> dict[str, TPStyle]:
        """Plan entries that are the LM head, by pattern, with the head style each gets."""
        if model is None:
            return {}
        modules = {name: m for name, m in model.named_modules() if name}

        def matched(pattern: str) -> list[str]:
            return [n for n in modules if match_pattern(pattern, n)]

        vocab: dict[int, int] = {}  # id of a vocab embedding's weight -> its vocabulary
        regions: list[str] = []
        for pattern, style in plan.entries:
            for name in matched(pattern):
                m = modules[name]
                if style.name in _VOCAB_LIKE and isinstance(m, nn.Embedding):
                    vocab[id(m.weight)] = m.num_embeddings
                elif style.name in _REGION_LIKE:
                    regions.append(name)
        out: dict[str, TPStyle] = {}
        for pattern, style in plan.entries:
            if style.name not in _HEAD_LIKE:
                continue
            names = matched(pattern)
            if style.name == "colwise" and not (
                names
                and all(
                    is_dense(modules[n])
                    and int(dense_weights(modules[n])[0].shape[0]) in vocab.values()
                    and not any(n.startswith(r + ".") for r in regions)
                    for n in names
                )
            ):
                continue  # a colwise layer that is not the LM head
            tied = any(id(getattr(modules[n], "weight", None)) in vocab for n in names)
            out[pattern] = self.tied_head if tied and self.tied_head is not None else self.roles["head"]
        return out


_MODES: dict[TPMode, ModeSpec] = {}


def register_mode(spec: ModeSpec, *, replace: bool = False) -> ModeSpec:
    """Make ``spec`` the translation of its mode; another spec for the mode is a ValueError
    unless ``replace``."""
    other = _MODES.get(spec.mode)
    if other is not None and other is not spec and not replace:
        raise ValueError(f"tp mode {spec.mode.value!r} already has a spec: {other!r}")
    _MODES[spec.mode] = spec
    return spec


def mode_spec(mode: TPMode | str) -> ModeSpec:
    """The registered spec of ``mode``; ValueError naming the known modes otherwise."""
    try:
        return _MODES[TPMode(mode)]
    except (KeyError, ValueError):
        raise ValueError(f"unknown tp mode {mode!r}; known: {', '.join(m.value for m in _MODES)}") from None


def registered_modes() -> dict[TPMode, ModeSpec]:
    """Every registered mode's spec."""
    return dict(_MODES)


def plan_for_mode(
    plan: PlanLike, mode: TPMode | str, model: nn.Module | None = None, *, depth: int | None = None
) -> Plan:
    """``plan``, written in roles, as ``mode``'s plan (``ModeSpec.translate``); ``model`` lets
    the LM head be found and its tie kept; ``depth`` binds 2.5D's depth (ignored elsewhere)."""
    spec = mode_spec(mode)
    return spec.translate(plan, model, depth=depth if spec.mode is TPMode.TWO_P5_D else None)


def _hidden_2p5d(mesh: Mesh) -> tuple[int, Group, int]:
    grid = Grid2p5D.from_mesh(mesh)
    return grid.q, grid.row, grid.j


def _hidden_3d(mesh: Mesh) -> tuple[int, Group, int]:
    cube = Cube3D.from_mesh(mesh)
    return cube.q, cube.output, cube.c


def _blocks_2d(mesh: Mesh) -> tuple[StreamGather, ...]:
    grid = Grid2D.from_mesh(mesh)  # rank (i, j): batch block i, hidden block j
    return ((-1, grid.row), (0, grid.col))


def _blocks_2p5d(mesh: Mesh) -> tuple[StreamGather, ...]:
    grid = Grid2p5D.from_mesh(mesh)  # rank (k, i, j): batch block k*q + i, hidden block j
    return ((-1, grid.row), (0, grid.col), (0, grid.dep))


def _blocks_3d(mesh: Mesh) -> tuple[StreamGather, ...]:
    cube = Cube3D.from_mesh(mesh)  # stream layout: batch block b*q + a, hidden block c
    return ((-1, cube.output), (0, cube.input), (0, cube.weight))


def _nd(
    mode: TPMode,
    geo: Geometry,
    *,
    objective: Callable[[Mesh], ModeObjective],
    blocks: Callable[[Mesh], tuple[StreamGather, ...]],
    linear: TPStyle,
    linear_back: TPStyle,
    classifier: TPStyle,
    layernorm: TPStyle,
    embedding: TPStyle,
    vocab: TPStyle,
    tied_head: TPStyle | None,
) -> ModeSpec:
    m = mode.value
    norm = NormND(f"{m}_norm", exact=layernorm, geometry=geo)
    embed = embedding
    qkv = DenseND(f"{m}_colwise_qkv", twin=linear, geometry=geo, sections=3)
    roles: dict[str, TPStyle] = {
        "colwise": DenseND(f"{m}_colwise", twin=linear, geometry=geo),
        "rowwise": DenseND(f"{m}_rowwise", twin=linear_back, geometry=geo),
        "colwise_qkv": qkv,
        "colwise_qkv_heads": qkv,  # equal parts: AttentionND refuses a fused q|k|v of grouped KV heads
        "colwise_gate_up": DenseND(f"{m}_colwise_gate_up", twin=linear, geometry=geo, sections=2),
        "vocab": vocab,
        "head": DenseND(f"{m}_head", twin=classifier, geometry=geo),
        "embedding": embed,
        "sequence_split": embed,
        "norm": norm,
        "sequence_norm": norm,
        "attention": AttentionND(f"{m}_attention", geometry=geo),
        "region": KeepND(f"{m}_region"),
        "replicate": Replicate(f"{m}_replicate", grad_complete=False),
        "dropout": Style.DROPOUT_SPLIT,
        "dropout_split": Style.DROPOUT_SPLIT,
        # the 1D sequence-parallel boundaries of HF models: in nD the same roles as their plain twins
        "vocab_whole": vocab,
        "embedding_whole": embed,
        "dropout_whole": Style.DROPOUT_SPLIT,
        "sequence_start": KeepND(f"{m}_sequence_start"),
        "sequence_end": norm,
        "colwise_whole": DenseND(f"{m}_head", twin=classifier, geometry=geo),
    }
    refused = {
        "colwise_gather": f"its output is gathered whole, but {m} keeps every activation split; use colwise "
        "with a rowwise layer after it",
    }
    native = {"2d": "2d_", "2.5d": "2.5d_", "3d": "3d_"}[m]
    return ModeSpec(mode, objective, roles, refused, native, tied_head, blocks=blocks)


ONE_D = register_mode(ModeSpec(TPMode.ONE_D, objective_1d, identity=True))
TWO_D = register_mode(
    _nd(
        TPMode.TWO_D,
        Geometry(TPMode.TWO_D, _hidden_2d),
        objective=objective_2d,
        blocks=_blocks_2d,
        linear=Styles2D.LINEAR,
        linear_back=Styles2D.LINEAR,
        classifier=Styles2D.CLASSIFIER,
        layernorm=Styles2D.LAYERNORM,
        embedding=Styles2D.EMBEDDING,
        vocab=Styles2D.VOCAB_EMBEDDING,
        tied_head=TiedHead2D("2d_tied_head"),
    )
)
TWO_P5_D = register_mode(
    _nd(
        TPMode.TWO_P5_D,
        Geometry(TPMode.TWO_P5_D, _hidden_2p5d, depth=None),
        objective=objective_2p5d,
        blocks=_blocks_2p5d,
        linear=Styles2p5D.LINEAR,
        linear_back=Styles2p5D.LINEAR,
        classifier=Styles2p5D.CLASSIFIER,
        layernorm=Styles2p5D.LAYERNORM,
        embedding=Styles2p5D.EMBEDDING,
        vocab=Styles2p5D.VOCAB_EMBEDDING,
        tied_head=TiedHead2D("2.5d_tied_head", depth_replicated=True),
    )
)
THREE_D = register_mode(
    _nd(
        TPMode.THREE_D,
        Geometry(TPMode.THREE_D, _hidden_3d),
        objective=objective_3d,
        blocks=_blocks_3d,
        linear=Styles3D.LINEAR,
        linear_back=Styles3D.LINEAR_BACK,
        classifier=Styles3D.CLASSIFIER,
        layernorm=Styles3D.LAYERNORM,
        embedding=Styles3D.EMBEDDING,
        vocab=Styles3D.VOCAB_EMBEDDING,
        tied_head=None,
    )
)
