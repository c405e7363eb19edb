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
side; alternating, with biases and a clamped SwiGLU), read as ``hf_moe_kinds.BankLayout`` says.

A part is recognised by the *source* of its ``forward``: each kind in ``hf_moe_kinds`` was
written for one forward (named by the ``transformers`` class it was read from) and holds the
`source_key` of it, a hash of its tokens (comments and line breaks inside brackets ignored).
A family that copies that forward, under any class name, is read by the same kind; a forward
that differs in anything but comments and layout (a new ``transformers``) is not recognised,
and the block is refused, naming the class and the key, until someone reads it and adds a
kind. The attributes the kind then reads (``top_k``, ``norm_topk_prob``, ``n_group``, ...)
are the instance's own. Kinds known to compute what ``tessera.moe`` cannot (PhiMoE's
sparsemixer, DeepSeek-V4's hash routing, ...) are listed there with the reason, which
`read_layout` gives. ``tests/survey_hf_moe.py`` lists every MoE family of the pinned
``transformers`` against them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from tessera.launcher.families.hf_moe_kinds import (
    BANKS,
    BLOCK_KINDS,
    ROUTER_KINDS,
    SHARED_MLP,
    SHARED_MLP_LLAMA4,
    BankLayout,
    BlockKind,
    RouterKind,
    source_key,
)
from tessera.moe import Activation, ClampedSwiGLU, RouterSpec, Weigh

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
    ``returns_logits``: the block returns ``(out, router_logits)``."""

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


def _silu(act: Any, where: str) -> None:
    if (
        act is not F.silu
        and not isinstance(act, nn.SiLU)
        and type(act).__name__ not in ("SiLUActivation", "SiLU")
    ):
        raise ValueError(
            f"{where}: activation {type(act).__name__} is not SiLU; tessera.moe's SwiGLU needs SiLU"
        )


_SHARED_ACTIVATION = {SHARED_MLP[1]: "act_fn", SHARED_MLP_LLAMA4[1]: "activation_fn"}


def _shared_hidden(shared: Any, where: str) -> int:
    act = _SHARED_ACTIVATION.get(source_key(type(shared).forward))
    if act is None:
        raise ValueError(
            f"{where} ({type(shared).__name__}) is not a SwiGLU MLP like {SHARED_MLP[0]} or "
            f"{SHARED_MLP_LLAMA4[0]}"
        )
    _silu(getattr(shared, act), where)
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(shared, name).bias is not None:
            raise ValueError(f"{where}.{name} has a bias; tessera.moe's shared expert has none")
    return int(shared.gate_proj.weight.shape[0])


def read_layout(block: nn.Module) -> HFLayout:
    """``block`` (an HF sparse MoE block) in ``tessera.moe.MoE``'s terms; ValueError naming
    the class and why when it cannot be reproduced."""
    name = type(block).__name__
    try:
        kind: BlockKind = _kind(BLOCK_KINDS, block, "block")
        problem = kind.refusal or (kind.check(block) if kind.check else "")
        if problem:
            raise ValueError(problem)
        bank: Any = block.experts
        like = BANKS[kind.bank]
        if source_key(type(bank).forward) != like[1]:
            raise ValueError(f"its experts {type(bank).__name__} do not compute what {like[0]} computes")
        if kind.bank == "interleaved":
            activation: Activation = ClampedSwiGLU(float(bank.alpha), float(bank.limit))
        else:
            _silu(bank.act_fn, f"{name}.experts")
            activation = "swiglu"
        rkind: RouterKind = _kind(ROUTER_KINDS, getattr(block, kind.router), "router")
        if rkind.read is None:
            raise ValueError(rkind.refusal)
        reading = rkind.read(block, kind.router)
        owner = block.get_submodule(reading.weight.rpartition(".")[0])
        if isinstance(owner, nn.Linear) and owner.bias is not None:
            raise ValueError(f"its router's {reading.weight} has a bias; tessera.moe's router has none")
        if kind.scale is not None:
            factor = float(getattr(block, kind.scale)) * reading.routing.scale
            reading = replace(reading, routing=replace(reading.routing, scale=factor))
        shared = getattr(block, kind.shared, None) if kind.shared else None
        shared_hidden = None if shared is None else _shared_hidden(shared, f"{name}.{kind.shared}")
        gate = getattr(block, kind.shared_gate) if kind.shared_gate and shared is not None else None
        if gate is not None and getattr(gate, "bias", None) is not None:
            raise ValueError(f"{name}.{kind.shared_gate} has a bias; tessera.moe's shared gate has none")
    except (AttributeError, TypeError) as exc:
        raise ValueError(
            f"{name}: not the layout its forward's kind reads ({type(exc).__name__}: {exc})"
        ) from exc
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    gate_up: Tensor = bank.gate_up_proj  # [E, 2h, d], or with columns [E, d, 2h]
    d_dim, h_dim = (2, 1) if kind.bank == "rows" else (1, 2)
    return HFLayout(
        block=f"{kind.name} ({kind.like})",
        router=f"{rkind.name} ({rkind.like})",
        experts=int(gate_up.shape[0]),
        d_model=int(gate_up.shape[d_dim]),
        hidden=int(gate_up.shape[h_dim]) // 2,
        top_k=reading.top_k,
        renormalize=reading.renormalize,
        routing=reading.routing,
        router_weight=reading.weight,
        score_bias=reading.bias,
        shared=None if shared is None else kind.shared,
        shared_hidden=shared_hidden,
        shared_gate=None if gate is None else kind.shared_gate,
        weigh=kind.weigh,
        bank=kind.bank,
        returns_logits=kind.returns_logits,
        router_bias=reading.logit_bias,
        activation=activation,
    )
