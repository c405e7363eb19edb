"""The model contract: what ``boost()`` needs to know about a model it has never seen.

A `ModelSpec` says how to split the model into pipeline blocks, how to read logits from
what it returns, which loss to train, and which tensor-parallel plan each mode uses. Every
field has a default that fits a plain causal language model (``model(ids)`` returns logits
or an object with ``.logits``; its layers are one ``nn.ModuleList``), so most models need
no spec at all; ``boost()`` looks up a registered spec by the model's class first (the
reference GPT and Hugging Face GPT-2 / Llama are registered, see ``tessera.launcher.families.hf``).

Pipeline blocks, found automatically: the ``nn.ModuleList`` holding the most parameters is
the layer stack; the modules registered before it (at every level from the root down to
it) run before the layers, those registered after it run after them, each called on the
previous one's output. ``boost(..., example=batch)`` checks that this sequence reproduces
``model(batch)`` before anything is partitioned; a model whose forward does more than
chaining its children (adds position embeddings, scales, passes masks) passes
``ModelSpec(blocks=fn)``, a function returning the blocks in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import TPMode
from tessera.launcher.families.derived_roles import derive_roles
from tessera.tensor_parallel import PlanLike
from tessera.tensor_parallel.modes import plan_for_mode
from tessera.zero.units import largest_module_list

__all__ = [
    "HoldingBlock",
    "ModelSpec",
    "check_blocks",
    "layer_stack",
    "logits_of",
    "model_family",
    "model_spec",
    "pipeline_blocks",
    "refusals",
    "register_model_family",
    "register_model_spec",
    "tied_blocks",
]

log = logging.getLogger(__name__)

Loss = Callable[[Tensor, Tensor], Tensor]


def logits_of(output: Any) -> Tensor:
    """The logits in a model's output: the tensor itself, an output object's ``.logits``
    (Hugging Face ``ModelOutput``), or the first element of a tuple."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(
        f"cannot find logits in the model's output of type {type(output).__name__}; pass "
        "ModelSpec(output=fn) with fn(output) -> logits"
    )


@dataclass(frozen=True)
class ModelSpec:
    """How ``boost()`` drives a model (see the module docstring).

    ``roles``: one plan of roles serving every tensor-parallel mode (``tessera.tensor_parallel.
    modes.plan_for_mode`` translates it to the mode in use). ``plans``: a plan for one mode
    (``"1d"``, ``"2d"``, ``"2.5d"``, ``"3d"``), taking precedence over ``roles`` there.
    ``blocks``: the pipeline blocks: a function ``model -> [block, ...]``, the dotted name of
    the layers' ``nn.ModuleList``, or None (found automatically). ``loss(logits, targets)``:
    the mean loss of this rank's batch; None trains the exact cross-entropy of the mode
    (vocab-parallel logits under 1D tensor parallelism). ``output``: the logits in what the
    model returns. ``attention_cores`` / ``positions``: for context parallelism (cp), the
    plan-style names of the attention cores (called on q, k, v; None: the model's
    ``F.scaled_dot_product_attention`` calls are found and routed) and of the modules indexed
    by position (learned embeddings, rotary modules; comma-separated; rotary modules are also
    found by class), see ``tessera.tensor_parallel.context_parallelize``. ``refuses``: the
    parallel axes the model cannot take (``"tp"``, ``"sequence_parallel"``, ``"pp"``,
    ``"cp"``, and ``"batch"``: any split of the step's batch, over dp, cp or microbatches),
    each with the reason; ``refused_by(model)``: those of one model of the family (a setting of
    its config); ``boost()`` refuses them before building anything.
    With neither ``plans`` nor ``roles`` for a mode, the roles are derived from the model's
    module tree (``derived_roles.derive_roles``, logged so that they can be copied).
    """

    plans: Mapping[str, PlanLike] = field(default_factory=dict)
    roles: PlanLike | None = None
    blocks: str | Callable[[nn.Module], Sequence[nn.Module]] | None = None
    loss: Loss | None = None
    output: Callable[[Any], Tensor] = logits_of
    attention_cores: str | None = None
    positions: str | None = None
    refuses: Mapping[str, str] = field(default_factory=dict)
    refused_by: Callable[[nn.Module], Mapping[str, str]] | None = None

    def plan(
        self,
        mode: TPMode,
        model: nn.Module,
        *,
        depth: int | None = None,
        adjust: Callable[[PlanLike], PlanLike] | None = None,
    ) -> PlanLike:
        """The plan for tensor-parallel ``mode``: ``plans[mode]``, else ``roles`` translated to
        the mode (for ``model``; ``depth``: 2.5D's; ``adjust``: applied to the plan of roles
        before it is translated); ValueError naming the modes there are."""
        plan = self.plans.get(mode.value, self.roles)
        if plan is None and self.plans:
            offered = ", ".join(sorted(self.plans))
            raise ValueError(
                f"no tensor-parallel plan for {type(model).__name__} in mode {mode.value} (plans: "
                f"{offered}); pass boost(..., plan=...) or ModelSpec(roles=plan)"
            )
        if plan is None:
            try:
                plan = derive_roles(model)
            except ValueError as exc:
                raise ValueError(
                    f"no tensor-parallel plan for {type(model).__name__} in mode {mode.value} and none "
                    f"could be derived ({exc}); pass boost(..., plan=...) or ModelSpec(roles=plan)"
                ) from exc
        return plan_for_mode(plan if adjust is None else adjust(plan), mode, model, depth=depth)


_REGISTRY: dict[str, ModelSpec] = {}
_FAMILIES: dict[str, ModelSpec] = {}


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_model_spec(cls: type | str, spec: ModelSpec) -> None:
    """Make ``spec`` the default of every model of class ``cls`` (a class or its dotted
    ``module.QualName``, so registering needs no import of the model's library)."""
    _REGISTRY[cls if isinstance(cls, str) else _key(cls)] = spec


def register_model_family(model_type: str, spec: ModelSpec) -> None:
    """Make ``spec`` the default of every Hugging Face model whose ``config.model_type`` is
    ``model_type`` and whose class has no spec of its own (``tessera.launcher.families.known``);
    ``"*"``: of every Hugging Face model whose family has none."""
    _FAMILIES[model_type] = spec


def model_family(model: nn.Module) -> str | None:
    """``config.model_type`` of a Hugging Face model, None for any other model."""
    if not type(model).__module__.startswith("transformers."):
        return None
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if isinstance(kind, str) else None


def refusals(model: nn.Module, spec: ModelSpec, axes: Sequence[str]) -> list[str]:
    """``"axis: reason"`` for each of ``axes`` (``tp``, ``sequence_parallel``, ``pp``, ``cp``,
    ``batch``) that ``model`` cannot take: its spec's ``refuses`` and ``refused_by(model)``, and
    context parallelism (``cp``) on attention whose logits are soft-capped (Gemma2's
    ``attn_logit_softcapping``), and sequence parallelism on layers that take per-layer inputs
    of the whole sequence (Gemma 4's ``hidden_size_per_layer_input``)."""
    own = {**spec.refuses, **(spec.refused_by(model) if spec.refused_by is not None else {})}
    refused = {axis: own[axis] for axis in axes if axis in own}
    cap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
    if "cp" in axes and cap is not None and "cp" not in refused:
        refused["cp"] = (
            f"its attention logits are soft-capped (tanh, attn_logit_softcapping={cap}), which ring and "
            "Ulysses attention do not apply (they run scaled dot-product attention)"
        )
    per_layer = getattr(getattr(model, "config", None), "hidden_size_per_layer_input", None)
    if "sequence_parallel" in axes and per_layer and "sequence_parallel" not in refused:
        refused["sequence_parallel"] = (
            f"its layers take per-layer inputs of the whole sequence (hidden_size_per_layer_input="
            f"{per_layer}, made from the token ids) beside hidden states that sequence parallelism "
            "splits by position"
        )
    return [f"{axis}: {reason}" for axis, reason in refused.items()]


def model_spec(model: nn.Module) -> ModelSpec:
    """The registered spec of ``model``'s class (or of its nearest registered base), else of
    its Hugging Face family (``config.model_type``), else the default ``ModelSpec()``."""
    for cls in type(model).__mro__:
        spec = _REGISTRY.get(_key(cls))
        if spec is not None:
            return spec
    family = model_family(model)
    if family is not None:  # "*": the default of every Hugging Face family not registered
        return _FAMILIES.get(family) or _FAMILIES.get("*") or ModelSpec()
    return ModelSpec()


# ---------------------------------------------------------------------------- pipeline blocks
def layer_stack(model: nn.Module) -> str:
    """The dotted name of the ``nn.ModuleList`` holding the most parameters
    (``tessera.zero.units.largest_module_list``, which also gives ZeRO-3 its units)."""
    best = largest_module_list(model)
    if best is None:
        raise ValueError(
            f"cannot split {type(model).__name__} into pipeline blocks: it has no nn.ModuleList of "
            "layers; pass ModelSpec(blocks=fn) with fn(model) -> [block, ...]"
        )
    return best


def _around(model: nn.Module, path: str) -> tuple[list[nn.Module], nn.ModuleList, list[nn.Module]]:
    """The modules registered before the ModuleList at ``path`` (outermost level first), the
    list, and those registered after it (innermost level first)."""
    before: list[nn.Module] = []
    after: list[list[nn.Module]] = []
    parent = model
    for part in path.split("."):
        names = [n for n, _ in parent.named_children()]
        if part not in names:
            raise ValueError(f"{type(model).__name__} has no submodule {path!r} (at {part!r})")
        at = names.index(part)
        children = [c for _, c in parent.named_children()]
        before += children[:at]
        after.append(children[at + 1 :])
        parent = children[at]
    if not isinstance(parent, nn.ModuleList):
        kind = type(parent).__name__
        raise ValueError(f"{path!r} of {type(model).__name__} is a {kind}, not an nn.ModuleList")
    return before, parent, [m for level in reversed(after) for m in level]


def pipeline_blocks(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """``model`` as a sequence of blocks for the pipeline partitioner (see the module
    docstring). A parameter may sit in several blocks (tied embeddings): see `tied_blocks`.
    Parameters of the model that no block holds (the blocks reproduce its logits without them:
    Inkling 2 Loop's message queries when it makes one pass) are held by the first block too
    (`HoldingBlock`), so that its stage keeps, saves and exports them."""
    if callable(spec.blocks):
        blocks = list(spec.blocks(model))
    else:
        path = spec.blocks if spec.blocks is not None else layer_stack(model)
        before, layers, after = _around(model, path)
        blocks = [*before, *layers, *after]
        log.info(
            "pipeline blocks of %s: %d before %s, %d layers, %d after",
            type(model).__name__, len(before), path, len(layers), len(after),
        )  # fmt: skip
    held = {id(p) for block in blocks for p in block.parameters()}
    loose = [(n, p) for n, p in model.named_parameters() if id(p) not in held]
    if blocks and loose:
        log.info(
            "%d parameters of %s are in no pipeline block, held by the first: %s",
            len(loose), type(model).__name__, ", ".join(n for n, _ in loose[:8]),
        )  # fmt: skip
        blocks[0] = HoldingBlock(blocks[0], [p for _, p in loose])
    return blocks


class HoldingBlock(nn.Module):
    """A pipeline block (``block``) that also holds parameters of the model it does not compute
    with (`pipeline_blocks`): its forward is the block's."""

    def __init__(self, block: nn.Module, held: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.block = block
        self.held = nn.ParameterList(held)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


def tied_blocks(blocks: Sequence[nn.Module]) -> dict[nn.Parameter, list[int]]:
    """Every parameter held by more than one block (tied embeddings), with those blocks."""
    holders: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for b, block in enumerate(blocks):
        for param in block.parameters():
            entry = holders.setdefault(id(param), (param, []))
            if b not in entry[1]:
                entry[1].append(b)
    return {param: where for param, where in holders.values() if len(where) > 1}


def vocabulary(model: nn.Module) -> int | None:
    """The number of token ids ``model`` takes: ``config.vocab_size``, else the rows of its first
    embedding (``nn.Embedding``, or one split by tensor parallelism: its ``num_embeddings``
    counts them all); None when it has neither."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    for module in model.modules():
        rows = getattr(module, "num_embeddings", None)
        if "Embedding" in type(module).__name__ and isinstance(rows, int):
            return rows
    return None


def example_ids(model: nn.Module, example: Tensor | None, *, tokens: int = 8) -> Tensor | None:
    """``example`` if given, else a (1, ``tokens``) batch of random token ids within the model's
    `vocabulary` (from a fixed seed: every rank draws the same), None when it has none."""
    if example is not None:
        return example
    vocab = vocabulary(model)
    if vocab is None:
        return None
    like = next(iter(model.parameters()), None)
    device = like.device if like is not None and not like.is_meta else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, tokens), generator=gen).to(device)


@torch.no_grad()
def check_blocks(
    model: nn.Module, blocks: Sequence[nn.Module], example: Tensor | None, output: Callable[[Any], Tensor]
) -> None:
    """ValueError unless running ``blocks`` in order on ``example`` reproduces the logits of
    ``model(example)`` (in eval mode, to 1e-5 of their largest magnitude); also when a block
    fails on what the one before it returns. Nothing is checked without an example, or on a
    model built on the meta device (``deferred_parameters``)."""
    if example is None or any(p.is_meta for p in model.parameters()):
        log.info(
            "pipeline blocks of %s not checked (no example, or deferred parameters)", type(model).__name__
        )
        return
    was_training = model.training
    model.eval()
    try:
        want = output(model(example))
        got = example
        for index, block in enumerate(blocks):
            try:
                got = block(got)
            except Exception as exc:
                kind = f"{type(model).__name__} ({type(block).__name__})"
                raise ValueError(
                    f"pipeline block {index} of {len(blocks)} of {kind} fails on the previous block's "
                    f"output ({type(exc).__name__}: {exc}): its forward needs more than the hidden states "
                    "(masks, positions); pass ModelSpec(blocks=fn) with blocks that make them, as "
                    "tessera.launcher.families.hf.decoder_blocks does"
                ) from exc
    finally:
        model.train(was_training)
    if not isinstance(got, Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        raise ValueError(
            f"the pipeline blocks of {type(model).__name__} give {shape}, the model {tuple(want.shape)}: "
            "its forward is not the chain of its blocks; pass ModelSpec(blocks=fn)"
        )
    diff = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max()) or 1.0
    if diff > 1e-5 * scale:
        raise ValueError(
            f"the pipeline blocks of {type(model).__name__} do not reproduce model(example): largest "
            f"difference {diff:.3g} (logits up to {scale:.3g}); pass ModelSpec(blocks=fn)"
        )
