"""A plan of roles read from a model's module tree, for a model no registered spec knows.

Decoder-only language models share one shape: a token embedding, a stack of layers (the
``nn.ModuleList`` holding the most parameters), a final norm and an LM head. Inside each
layer an *attention* module holds the projections that feed its attention (column-parallel)
and the one after it (row-parallel), an *MLP* module holds two or three dense layers (the
last row-parallel), a converted *mixture* (``tessera.moe.MoE``) has its experts split inside,
and the norms between them stay whole. `derive_roles` reads every layer, each child of it:

- a norm: a leaf module whose class name says ``Norm`` (also after the stack);
- a mixture of experts (``tessera.moe.MoE``, what ``hf_moe`` converts Hugging Face sparse
  blocks into): the ``moe`` style (``tessera.launcher.train.moe_style``: every expert split
  inside over tp, the router whole; it takes Megatron sequence parallelism), or kept whole
  where its experts cannot be split at any tp (each expert's output normalised: Ergo's);
- the attention module: a submodule whose class name says ``Attention`` (or that says its
  head count: ``num_heads``, ``n_heads``, ... as ``heads.head_layout`` reads) and that holds
  dense layers (``nn.Linear`` or HF ``Conv1D``); its output projection is the dense layer
  whose name says so (``o_proj``, ``out_proj``, ``dense``, ``c_proj``, ``wo``); every other
  dense layer in it feeds the attention. A single input projection producing q, k and v
  together is ``colwise_qkv`` (sections ``[q | k | v]``) unless the model's own hint (Hugging
  Face's ``config.base_model_tp_plan``) or its name (``query_key_value``) says it is split per
  head (GPT-NeoX, Bloom and Falcon interleave q, k, v inside each head). A latent attention
  (DeepSeek's: ``kv_a_proj_with_mqa`` and ``kv_b_proj``) splits only its per-head
  projections (``q_proj`` or ``q_b_proj``, ``kv_b_proj``, a gate with one output per head as
  Ling's ``g_proj``) and ``o_proj``'s input; the low-rank projections in front of them, their
  norms and a sparse-attention indexer stay whole inside; a projection of its own with another
  width keeps the whole attention whole;
- the MLP: another submodule holding two or more dense layers; its output layer is the one
  whose input width is not the block's (it takes the hidden width the others produce; a
  fused ``gate | up`` producing twice that width is split in two sections);
- kept whole (``replicate``; each rank runs it on the whole sequence, its gradients complete):
  a sublayer this reading cannot split. A module holding parameters outside dense layers and
  norms (a Mamba mixer, a gated-delta-net linear attention, attention sinks), dense layers
  beside a norm of their own (AXK2's adaptive norm: its output is not the MLP's), an attention
  whose heads cannot be read (Qwen3-Next's gated query projection, twice the heads' width),
  whose norms span a whole projection (OLMo2's ``q_norm``) or whose indexer chooses keys from
  its own heads (Kolibri 1.1's, which has no weights), and any other sublayer holding
  parameters. A plan with such a module refuses sequence parallelism
  (``supports_sequence_parallel=False``: the module would see one rank's slice of the sequence);
- the token embedding (``vocab_whole``; one that holds a module with weights of its own, such
  as Inkling's norm after the lookup, whole: ``replicate``), learned position embeddings
  (``embedding_whole``), layer 0 (``sequence_start``) and the LM head (``head``).

An entry that every layer shares is written once over the stack (``model.layers.*.mlp``);
one that only some layers have (a dense first layer before mixtures, a hybrid's Mamba layers
between attention layers) is written per layer (``model.layers.0.mlp``).

Nothing here trusts itself: ``parallelize`` probes the first attention module and the first
other region of each class (its shards must add up to it: a module read as an MLP that does
more is refused) and every replaced module on a random input before training, and the
coverage proof accounts for every
parameter, so a wrong guess is refused, naming the module, never trained. `describe` writes
the plan out so that a user can copy it into ``ModelSpec(roles=...)`` and edit it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from tessera.launcher.train.moe_style import MOE_STYLE
from tessera.moe import MoE
from tessera.moe.layer import hidden_split_problem
from tessera.tensor_parallel import Plan, Style
from tessera.tensor_parallel.adapted import dense_core, has_adapters
from tessera.tensor_parallel.heads import HeadLayout, head_layout
from tessera.tensor_parallel.layers import dense_weights, is_dense
from tessera.tensor_parallel.roles import Roles
from tessera.tensor_parallel.style import Role, TPStyle
from tessera.zero.units import largest_module_list

__all__ = ["derive_roles", "describe"]

log = logging.getLogger(__name__)

# a latent attention's low-rank projections in front of its per-head ones: whole on every rank
_LATENT_WHOLE = ("q_a_proj", "kv_a_proj_with_mqa")
_OUTPUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o", "proj", "out")
# fused q, k, v projections by this name interleave q, k and v inside each head (or KV group):
# GPT-NeoX, Bloom, Falcon's grouped layout; split per head like any colwise layer
_INTERLEAVED = "query_key_value"


def _dense(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The dense layers inside ``module``; a layer carrying adapters (PEFT's LoRA) counts as its
    base layer, and the layers inside it are not listed (the plan names the adapted layer)."""
    adapted: list[str] = []
    for name, sub in module.named_modules(prefix=prefix):
        if name == prefix or any(name.startswith(a + ".") for a in adapted):
            continue
        if has_adapters(sub):
            adapted.append(name)
        if is_dense(dense_core(sub)):
            yield name, sub


def _width(module: nn.Module) -> tuple[int, int]:
    out_f, in_f = dense_weights(dense_core(module))[0].shape
    return int(out_f), int(in_f)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not list(module.children())


def _hint(model: nn.Module) -> dict[str, str]:
    """Hugging Face's own tp plan of the model (patterns relative to the model's root)."""
    config: Any = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    base = getattr(model, "base_model_prefix", "")
    prefix = f"{base}." if base and hasattr(model, base) else ""
    return {prefix + k: str(v) for k, v in plan.items()}


def _layout(module: nn.Module) -> HeadLayout | None:
    """The module's heads (``heads.head_layout``); None when it does not say them, or says them
    inconsistently with its projections' widths (a gated query projection, twice as wide)."""
    try:
        return head_layout(module)
    except ValueError:
        return None


def _holds_more(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters outside dense layers and norms (a convolution, a
    state-space ``A_log``, attention sinks): a sublayer the derived roles cannot split."""
    covered: set[int] = set()
    for sub in module.modules():
        if has_adapters(sub) or is_dense(dense_core(sub)) or _is_norm(sub):
            covered.update(id(p) for p in sub.parameters())
    return any(id(p) not in covered for p in module.parameters())


def _reads_own_heads(module: nn.Module) -> bool:
    """Whether the attention holds a sparse-attention indexer with no weights of its own, which
    chooses keys from the attention's own heads (Kolibri 1.1's: its first query heads against key
    head 0): every rank must see every head to choose the same keys."""
    return any("indexer" in type(m).__name__.lower() and not list(m.parameters()) for m in module.modules())


def _attention_roles(path: str, module: nn.Module, hint: Mapping[str, str]) -> dict[str, TPStyle]:
    """An attention module's roles; ``{path: replicate}`` when its heads cannot be split as it is
    written (unreadable heads, a norm over a whole projection); empty when it is no attention."""
    dense = list(_dense(module, path))
    outputs = [n for n, _ in dense if n.rsplit(".", 1)[-1] in _OUTPUT_NAMES]
    if len(outputs) != 1 or len(dense) < 2:
        return {}
    layout = _layout(module)
    if layout is None or _reads_own_heads(module):
        return {path: Roles.REPLICATE}
    roles: dict[str, TPStyle] = {path: Style.ATTENTION, outputs[0]: Style.ROWWISE}
    children = dict(module.named_children())
    if "kv_a_proj_with_mqa" in children and "kv_b_proj" in children:  # latent attention
        for name, sub in children.items():
            if name in ("q_proj", "q_b_proj", "kv_b_proj"):
                roles[f"{path}.{name}"] = Style.COLWISE
            elif is_dense(dense_core(sub)) and name not in _LATENT_WHOLE and f"{path}.{name}" not in roles:
                if _width(sub)[0] != layout.heads:
                    return {path: Roles.REPLICATE}  # a projection of its own that the reading cannot place
                roles[f"{path}.{name}"] = Style.COLWISE  # one output per head (Ling's gate g_proj)
        return roles
    norms = [getattr(m, "weight", None) for m in module.modules() if _is_norm(m)]
    if any(w is not None and w.numel() != layout.head_dim for w in norms):
        return {path: Roles.REPLICATE}  # a norm over several heads at once
    inputs = [n for n, _ in dense if n != outputs[0]]
    for name in inputs:
        default = "colwise" if name.endswith(_INTERLEAVED) else "colwise_gather_output"
        fused = len(inputs) == 1 and hint.get(name, default) != "colwise"
        roles[name] = Style.COLWISE_QKV if fused else Style.COLWISE
    return roles


def _mlp_roles(path: str, module: nn.Module, *, direct: bool = False) -> dict[str, TPStyle]:
    """An MLP's roles: ``module`` a region; ``direct``: its own dense children, no region (OPT's
    ``fc1`` and ``fc2`` sit on the layer itself: each enters and leaves the tp region alone)."""
    dense = (
        [(f"{path}.{n}", m) for n, m in module.named_children() if is_dense(dense_core(m))]
        if direct
        else list(_dense(module, path))
    )
    if len(dense) < 2:
        return {}
    width = _width(dense[0][1])[1]  # the block's input width
    exits = [(n, m) for n, m in dense if _width(m)[1] != width]
    if len(exits) != 1:
        return {}  # not one hidden width feeding one output layer: left whole
    exit_name, exit_layer = exits[0]
    hidden = _width(exit_layer)[1]
    roles: dict[str, TPStyle] = (
        {exit_name: Style.ROWWISE} if direct else {path: Style.REGION, exit_name: Style.ROWWISE}
    )
    for name, sub in dense:
        if name == exit_name:
            continue
        out_f = _width(sub)[0]
        if out_f == hidden:
            roles[name] = Style.COLWISE
        elif out_f == 2 * hidden:
            roles[name] = Style.COLWISE_GATE_UP
        else:
            return {}
    return roles


def _is_attention(module: nn.Module) -> bool:
    """Its class name says Attention, or it says its head count (`_layout`)."""
    return "attention" in type(module).__name__.lower() or _layout(module) is not None


def _layer_roles(path: str, layer: nn.Module, hint: Mapping[str, str]) -> dict[str, TPStyle]:
    """The roles inside one layer of the stack (see the module docstring), by full name."""
    found: dict[str, TPStyle] = {}
    for rel, sub in layer.named_children():
        name = f"{path}.{rel}"
        roles: dict[str, TPStyle] = {}
        if _is_norm(sub):
            roles = {name: Roles.NORM}
        elif isinstance(sub, MoE):  # kept whole where no tp splits it (per-expert norms: Ergo's)
            roles = {name: Roles.REPLICATE if hidden_split_problem(sub, 1) else MOE_STYLE}
        elif is_dense(dense_core(sub)) or has_adapters(sub) or not list(sub.parameters()):
            continue  # a dense layer on the layer itself: the direct MLP below
        elif _holds_more(sub):
            roles = {name: Roles.REPLICATE}
        elif not _is_attention(sub) and any(_is_norm(m) and list(m.parameters()) for m in sub.modules()):
            roles = {name: Roles.REPLICATE}  # dense layers beside a norm (AXK2's adaptive norm): not an MLP
        elif _is_attention(sub):
            roles = _attention_roles(name, sub, hint)  # (an MLP holding the config says heads too)
        if not roles:
            roles = _mlp_roles(name, sub) or {name: Roles.REPLICATE}
        found.update(roles)
    if not any(style is Style.REGION for style in found.values()):
        found.update(_mlp_roles(path, layer, direct=True))
    return found


def _over_layers(stack: str, layers: list[dict[str, TPStyle]]) -> dict[str, TPStyle]:
    """The layers' roles as plan entries: an entry every layer has once as ``<stack>.*.<name>``,
    any other one per layer (``<stack>.<i>.<name>``), in the order the layers name them."""
    relative = [{k[len(f"{stack}.{i}.") :]: v for k, v in roles.items()} for i, roles in enumerate(layers)]
    entries: dict[str, TPStyle] = {}
    for i, roles in enumerate(relative):
        for rel, style in roles.items():
            if all(other.get(rel) is style for other in relative):
                entries[f"{stack}.*.{rel}"] = style
            else:
                entries[f"{stack}.{i}.{rel}"] = style
    return entries


def derive_roles(model: nn.Module) -> Plan:
    """A plan of roles for ``model`` read from its module tree (see the module docstring);
    ValueError when it has no layer stack, or no layer holding anything to split."""
    stack = largest_module_list(model)
    if stack is None:
        raise ValueError(
            f"cannot derive tensor-parallel roles for {type(model).__name__}: no nn.ModuleList of layers"
        )
    layers: Any = model.get_submodule(stack)
    hint = {k.removeprefix(f"{stack}.*."): v for k, v in _hint(model).items()}
    found = [
        _layer_roles(f"{stack}.{i}", layer, {f"{stack}.{i}.{k}": v for k, v in hint.items()})
        for i, layer in enumerate(layers)
    ]
    if not any(s is MOE_STYLE or s.role is Role.EXIT for roles in found for s in roles.values()):
        raise ValueError(
            f"cannot derive tensor-parallel roles for {type(model).__name__}: no layer of {stack} has an "
            "attention module, an MLP or a mixture of experts that splits; pass ModelSpec(roles=...)"
        )
    entries: dict[str, TPStyle] = {f"{stack}.0": Style.SEQUENCE_START, **_over_layers(stack, found)}
    entries.update(_outer_roles(model, stack))
    whole = [k for k, v in entries.items() if v is Roles.REPLICATE]
    name = f"derived-{type(model).__name__}"
    if whole:  # named in the plan's name, which a refusal of sequence parallelism quotes
        more = f" and {len(whole) - 4} more" if len(whole) > 4 else ""
        name += (
            f" (keeps {', '.join(whole[:4])}{more} whole on every tp rank, each seeing the whole sequence)"
        )
    plan = Plan.of(entries, name=name, supports_sequence_parallel=not whole)
    log.info("tensor-parallel roles derived for %s:\n%s", type(model).__name__, describe(plan))
    return plan


def _outer_roles(model: nn.Module, stack: str) -> dict[str, TPStyle]:
    """Embeddings, norms and the head: the modules outside the layer stack."""
    names = {id(m): n for n, m in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    tokens = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    roles: dict[str, TPStyle] = {}
    whole: list[str] = []  # a token embedding that does more than a lookup, and what it holds
    looks_up_more = tokens is not None and any(list(child.parameters()) for child in tokens.children())
    for name, sub in model.named_modules():
        if not name or name == stack or name.startswith((f"{stack}.", *(f"{w}." for w in whole))):
            continue
        if sub is tokens and looks_up_more:  # Inkling's normed embedding: a split would norm each share
            roles[name] = Roles.REPLICATE
            whole.append(name)
        elif sub is tokens or (tokens is None and isinstance(sub, nn.Embedding) and not roles):
            roles[name] = Style.VOCAB_WHOLE
        elif isinstance(sub, nn.Embedding):
            roles[name] = Style.EMBEDDING_WHOLE
        elif _is_norm(sub):
            roles[name] = Roles.NORM
    if head is not None and id(head) in names:
        roles[names[id(head)]] = Roles.HEAD
    elif head is None:
        last = [n for n, m in model.named_children() if is_dense(dense_core(m))]
        if last:
            roles[last[-1]] = Roles.HEAD
    return roles


def describe(plan: Plan) -> str:
    """The plan as Python source a user can paste into ``Plan.of({...})``."""
    lines = []
    for pattern, style in plan.entries:
        lines.append(f"    {pattern!r}: {style.name!r},")
    return "{\n" + "\n".join(lines) + "\n}"
