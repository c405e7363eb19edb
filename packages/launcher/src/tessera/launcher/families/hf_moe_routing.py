"""Which Hugging Face sparse MoE blocks ``tessera.moe.MoE`` reproduces, and how: the routers
and blocks of ``transformers``' MoE families, each recognised by its ``forward``, read into
an `HFLayout`.

Most MoE families of ``transformers`` share three parts, generated from one another
("modular" files) and differing only in names: experts ``experts.gate_up_proj [E, 2h, d]`` and
``experts.down_proj [E, d, h]`` computing ``down(silu(gate x) * up x)`` per expert; a router;
and a block that sums the routed experts' outputs, weighted by the router, and maybe a shared
SwiGLU expert (``gate_proj`` / ``up_proj`` / ``down_proj``), gated or not. What differs is the
router (softmax or sigmoid scores, a choice bias, groups, renormalisation, a scale) and the
block (where the router and the shared expert sit, where the choice bias is kept). Llama 4's
and GPT-OSS's experts hold gate and up in the columns of ``gate_up_proj [E, d, 2h]`` (side by
side; alternating, with biases and a clamped SwiGLU), read as ``hf_moe_kinds.BankLayout`` says;
which experts modules and shared experts each layout reads, and what they compute (ReLU², clamped
and softcapped SwiGLUs), is ``hf_moe_banks``'.
Some routers choose by the logits plus a bias (Kolibri), mask the groups they drop with 0.0
rather than ``-inf`` (AXK2) or guard their renormalisation with ``1e-6`` (LFM2), each a field
of ``tessera.moe.RouterSpec``; LongCat-Flash's routes to identity ("zero") experts after its
real ones, ``tessera.moe.MoE``'s ``identity_experts``; AXK1's normalises its output
(``post_norm_eps``). Ergo's experts each normalise their output with a norm of their own, and
its shared expert too (``expert_norm_eps``, ``shared_norm_eps``: ``hf_moe_expert_norms``); DeepSeek-V4's
first layers read each token's experts from a table by its id (``hash_vocab``; the converted layer
takes the ``input_ids`` its decoder layers pass); Inkling's
router scores its shared experts beside the routed ones and weighs them (``shared_scores``,
``shared_experts``, with a trained ``router_scale``).

A part is recognised by the *source* of its ``forward``: each kind in ``hf_moe_kinds`` was
written for one forward (named by the ``transformers`` class it was read from) and holds the
`source_key` of it, a hash of its tokens (comments and line breaks inside brackets ignored).
A family that copies that forward, under any class name, is read by the same kind; a forward
that differs in anything but comments and layout (a new ``transformers``) is not recognised,
and the block is refused, naming the class and the key, until someone reads it and adds a
kind. The attributes the kind then reads (``top_k``, ``norm_topk_prob``, ``n_group``, ...)
are the instance's own. Kinds known to compute what ``tessera.moe``'s routers cannot (PhiMoE's
sparsemixer, ZAYA's router state) are listed there with the reason, which `read_layout` gives;
their blocks convert with the router kept as transformers wrote it (``hf_moe_kept``).
``tests/survey_hf_moe.py`` lists every MoE family of the pinned ``transformers`` against them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from tessera.launcher.families.hf_moe_banks import bank_layout, bank_module, read_bank
from tessera.launcher.families.hf_moe_kinds import (
    BLOCK_KINDS,
    RMS_NORM,
    BankLayout,
    BlockKind,
    RouterKind,
    source_key,
)
from tessera.launcher.families.hf_moe_router_kinds import ROUTER_KINDS
from tessera.launcher.families.hf_moe_shared import SWIGLU_SHARED, SharedProjections, read_shared, shared_form
from tessera.moe import Activation, RouterSpec, Weigh

__all__ = ["HFLayout", "read_layout"]


@dataclass(frozen=True, slots=True)
class HFLayout:
    """What an HF sparse MoE block computes, in ``tessera.moe.MoE``'s terms, and where HF
    keeps each tensor (names relative to the block): the router's weight (and choice bias),
    ``experts.gate_up_proj`` / ``experts.down_proj`` (laid out as ``bank`` says, `BankLayout`),
    the bias of the router's logits ``router_bias``, the shared expert's
    ``gate_proj`` / ``up_proj`` / ``down_proj`` under ``shared`` and its gate ``shared_gate``;
    ``weigh``: where the router's weights apply (`tessera.moe.MoE`'s ``weigh``); ``activation``:
    the experts' (SiLU's SwiGLU, or GPT-OSS's clamped one);
    ``returns_logits``: the block returns ``(out, router_logits)``; ``identity_experts``: the
    router's choices beyond ``experts`` that give the token itself (LongCat-Flash's zero experts);
    ``post_norm``: the block's RMS norm of its output, of epsilon ``post_norm_eps``;
    ``shared_activation``: the shared expert's (HunYuan-V4's is not clamped where its experts
    are), ``shared_projections``: its ``w1`` / ``w3`` / ``w2`` as HF's projections (or their
    bands of rows: `hf_moe_banks.SharedProjections`); ``out_bias``: the bias ``[d]`` the block
    adds to its output (JetMoE's); ``expert_norm``: the bank's per-expert RMS norm weight ``[E, d]``
    of epsilon ``expert_norm_eps`` (Ergo's), ``shared_norm``: the shared expert's norm weight
    (relative to ``shared``) of epsilon ``shared_norm_eps``; ``shared_experts``: how many shared
    experts it holds, ``shared_stacked``: as parameters ``[S, out, in]`` (Inkling's);
    ``shared_scores``: the router weighs them (holding their logits after the routed experts');
    ``router_scale``: the router's trained scalar multiplying its weights (Inkling's);
    ``hash_table``: the router's table of each token id's experts ``[vocab, k]`` (DeepSeek-V4's
    ``tid2eid``: the converted router's ``tid2eid``, ``tessera.moe``'s hash routing)."""

    block: str
    router: str
    experts: int
    d_model: int
    hidden: int
    top_k: int
    renormalize: bool
    routing: RouterSpec
    router_weight: str
    score_bias: str | None
    shared: str | None
    shared_hidden: int | None
    shared_gate: str | None
    weigh: Weigh = "output"
    bank: BankLayout = "rows"
    returns_logits: bool = False
    router_bias: str | None = None
    activation: Activation = "swiglu"
    identity_experts: int = 0
    post_norm: str | None = None
    post_norm_eps: float | None = None
    shared_activation: Activation = "swiglu"
    shared_projections: SharedProjections = SWIGLU_SHARED
    out_bias: str | None = None
    expert_norm: str | None = None
    expert_norm_eps: float | None = None
    shared_norm: str | None = None
    shared_norm_eps: float | None = None
    shared_experts: int = 1
    shared_stacked: bool = False
    shared_scores: bool = False
    router_scale: str | None = None
    hash_table: str | None = None

    @property
    def columns(self) -> bool:
        """Whether the experts hold gate and up in the columns of ``gate_up_proj [E, d, 2h]``."""
        return self.bank != "rows"


def _kind(kinds: tuple[Any, ...], module: nn.Module, what: str) -> Any:
    key = source_key(type(module).forward)
    for kind in kinds:
        if kind.key == key:
            return kind
    raise ValueError(
        f"its {what} {type(module).__name__} has a forward tessera.moe has no reading of (source key "
        f"{key or 'unreadable'}); see tessera.launcher.families.hf_moe_kinds"
    )


def read_layout(block: nn.Module) -> HFLayout:
    """``block`` (an HF sparse MoE block) in ``tessera.moe.MoE``'s terms; ValueError naming
    the class and why when it cannot be reproduced. Its routing's ``weights_float32`` is left
    False: `hf_moe.moe_from_hf` reads it where it builds the router (`hf_dtypes.weighs_in_float32`,
    a forward of the block), as the export of the block's tensors does not need it."""
    name = type(block).__name__
    try:
        kind: BlockKind = _kind(BLOCK_KINDS, block, "block")
        problem = kind.refusal or (kind.check(block) if kind.check else "")
        if problem:
            raise ValueError(problem)
        bank = bank_layout(bank_module(block, kind.bank), kind.bank)  # Ergo's keeps its own
        found = read_bank(bank_module(block, bank), bank)  # its dims and activation
        rkind: RouterKind = _kind(ROUTER_KINDS, getattr(block, kind.router), "router")
        if rkind.read is None:
            raise ValueError(rkind.refusal)
        reading = rkind.read(block, kind.router)
        if rkind.float32:  # its logits in fp32 in any dtype
            reading = replace(reading, routing=replace(reading.routing, float32=True))
        owner = block.get_submodule(reading.weight.rpartition(".")[0])
        if isinstance(owner, nn.Linear) and owner.bias is not None:
            raise ValueError(f"its router's {reading.weight} has a bias; tessera.moe's router has none")
        identity = int(getattr(block, kind.identity) or 0) if kind.identity else 0
        choices = int(block.get_parameter(reading.weight).shape[0])
        if choices != found.experts + identity + reading.shared:
            raise ValueError(
                f"its router scores {choices} experts, not its {found.experts} experts, {identity} identity "
                f"experts and {reading.shared} shared experts"
            )
        norm = getattr(block, kind.post_norm) if kind.post_norm else None
        if norm is not None and source_key(type(norm).forward) != RMS_NORM[1]:
            raise ValueError(
                f"its {kind.post_norm} ({type(norm).__name__}) does not compute what {RMS_NORM[0]} does"
            )
        if kind.scale is not None:
            factor = float(getattr(block, kind.scale)) * reading.routing.scale
            reading = replace(reading, routing=replace(reading.routing, scale=factor))
        shared = getattr(block, kind.shared, None) if kind.shared else None
        shared_kind = None if shared is None else read_shared(shared, f"{name}.{kind.shared}")
        form = (1, False, None, None) if shared is None else shared_form(shared, found.d_model)
        if kind.shared_scores != bool(reading.shared) or (reading.shared and reading.shared != form[0]):
            raise ValueError(
                f"its router scores {reading.shared} shared experts, its block holds {form[0]} and "
                f"{'weighs them by the router' if kind.shared_scores else 'does not weigh them by it'}"
            )
        gate = getattr(block, kind.shared_gate) if kind.shared_gate and shared is not None else None
        if gate is not None and getattr(gate, "bias", None) is not None:
            raise ValueError(f"{name}.{kind.shared_gate} has a bias; tessera.moe's shared gate has none")
        if kind.out_bias is not None and tuple(block.get_parameter(kind.out_bias).shape) != (found.d_model,):
            shape = tuple(block.get_parameter(kind.out_bias).shape)
            raise ValueError(f"its output bias {kind.out_bias} is {shape}, not [{found.d_model}]")
    except (AttributeError, TypeError) as exc:
        raise ValueError(
            f"{name}: not the layout its forward's kind reads ({type(exc).__name__}: {exc})"
        ) from exc
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    return HFLayout(
        block=f"{kind.name} ({kind.like})",
        router=f"{rkind.name} ({rkind.like})",
        experts=found.experts,
        d_model=found.d_model,
        hidden=found.hidden,
        top_k=reading.top_k,
        renormalize=reading.renormalize,
        routing=reading.routing,
        router_weight=reading.weight,
        score_bias=reading.bias,
        shared=None if shared is None else kind.shared,
        shared_hidden=None if shared_kind is None else shared_kind[1],
        shared_gate=None if gate is None else kind.shared_gate,
        weigh=kind.weigh,
        bank=bank,
        returns_logits=kind.returns_logits,
        router_bias=reading.logit_bias,
        activation=found.activation,
        identity_experts=identity,
        post_norm=None if norm is None else kind.post_norm,
        post_norm_eps=None if norm is None else float(norm.variance_epsilon),
        shared_activation="swiglu" if shared_kind is None else shared_kind[2],
        shared_projections=SWIGLU_SHARED if shared_kind is None else shared_kind[0],
        out_bias=kind.out_bias,
        expert_norm=found.norm,
        expert_norm_eps=found.norm_eps,
        shared_norm=form[2],
        shared_norm_eps=form[3],
        shared_experts=form[0],
        shared_stacked=form[1],
        shared_scores=kind.shared_scores,
        router_scale=reading.scale,
        hash_table=reading.table,
    )
