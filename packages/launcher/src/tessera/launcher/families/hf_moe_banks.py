"""The expert banks of ``transformers``' sparse MoE blocks: each kind read
once from one class and recognised by the source of its ``forward`` (and of the ``_apply_gate``
it calls, which families override while keeping the forward), with what it computes as a
``tessera.moe`` activation and where its tensors sit as `ExportPart` s of the bank's ``w1`` /
``w3`` / ``w2``.

Banks (`BankLayout`, ``hf_moe_kinds``): Mixtral's fused ``gate_up_proj [E, 2h, d]`` by rows (and
the families that keep its layout but change the activation: HunYuan-V4's clamped SwiGLU,
MiniMax-M3's GPT-OSS-style clamped SwiGLU, Ling's SwiGLU clipped after the activation, Inkling
2's softcapped one); Llama 4's and Aria's by columns ``[E, d, 2h]``; GPT-OSS's alternating
columns with biases; Nemotron-H's non-gated ``up_proj [E, h, d]`` / ``down_proj [E, d, h]``
with ReLU² (``up_rows``); DBRX's ``mlp.w1`` / ``mlp.v1`` / ``mlp.w2``, each ``[E*h, d]``, one
``nn.Linear``-shaped gate and up and one ``[h, d]`` down per expert (``flat_rows``); Beam's
rows with its SwiGLU in fp32; JetMoE's ``input_linear`` / ``output_linear`` on the block itself
(``parallel_experts``: `bank_module`, `holds_parallel_experts`); Ergo's non-gated ``up_proj [E,
d, h]`` / ``down_proj [E, h, d]`` with ReLU² and a per-expert RMS norm (``up_columns``, the bank's
layout in DeepSeek-V3's block: `bank_layout`). Shared experts: a SwiGLU MLP (``gate_proj`` /
``up_proj`` / ``down_proj``), Ling's clipped one, Nemotron-H's non-gated ReLU² one (``up_proj`` /
``down_proj``), Ergo's ReLU² one ending in an RMS norm, and Inkling's ``S`` SwiGLU experts stacked
(``gate_proj`` / ``up_proj [S, h, d]``, ``down_proj [S, d, h]``: `shared_form`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import Band, ExportPart, assemble
from tessera.launcher.families.hf_moe_expert_norms import EXPERT_NORM, read_norm
from tessera.launcher.families.hf_moe_kinds import (
    EXPERTS,
    EXPERTS_COLUMNS,
    EXPERTS_GPT_OSS,
    BankLayout,
    source_key,
)
from tessera.moe import Activation, ClampedSwiGLU, SwiGLUVariant

__all__ = [
    "BANK_KINDS",
    "PART_LAYOUTS",
    "BankKind",
    "BankReading",
    "bank_key",
    "bank_layout",
    "bank_module",
    "bank_parts",
    "holds_bank",
    "holds_parallel_experts",
    "is_silu",
    "read_bank",
    "read_deepseek_v4",
    "read_minimax_m3",
    "read_parts",
    "read_relu2",
    "read_silu",
    "silu_of",
]


def bank_key(cls: type) -> str:
    """`source_key` of ``cls.forward``, and of its ``_apply_gate`` after a ``+`` where it has one."""
    gate = getattr(cls, "_apply_gate", None)
    key = source_key(getattr(cls, "forward"))  # noqa: B009
    return key if gate is None else f"{key}+{source_key(gate)}"


def is_silu(act: Any) -> bool:
    return act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def silu_of(act: Any) -> Activation:
    if not is_silu(act):
        raise ValueError(f"activation {type(act).__name__} is not SiLU; tessera.moe's SwiGLU needs SiLU")
    return "swiglu"


def read_silu(bank: Any) -> Activation:
    return silu_of(getattr(bank, "act_fn", None))


def read_relu2(bank: Any) -> Activation:
    if type(bank.act_fn).__name__ != "ReLUSquaredActivation":
        raise ValueError(f"activation {type(bank.act_fn).__name__} is not ReLU² (ReLUSquaredActivation)")
    return "relu2"


def _hy_v4(bank: Any) -> Activation:  # gate.clamp(max=L), up.clamp(-L, L), silu(gate) * up
    limit = float(bank.swiglu_limit)
    return SwiGLUVariant(gate_limit=limit, up_limit=limit)


def read_deepseek_v4(mlp: Any) -> Activation:  # DeepSeek-V4's experts and shared expert: as _hy_v4, limit
    read_silu(mlp)
    limit = float(mlp.limit)
    return SwiGLUVariant(gate_limit=limit, up_limit=limit)


def read_minimax_m3(bank: Any) -> Activation:  # GPT-OSS's, gate and up not interleaved
    return ClampedSwiGLU(float(bank.swiglu_alpha), float(bank.swiglu_limit))


def _bailing(bank: Any) -> Activation:  # silu(gate).clamp(max=L) * up.clamp(-L, L); no limit: SwiGLU
    read_silu(bank)
    limit = bank.limit
    return "swiglu" if limit is None else SwiGLUVariant(act_limit=float(limit), up_limit=float(limit))


_INKLING2_ACT = "60678ebb95bf49d7"  # Inkling2SoftcappedSwiGLU.forward


def _inkling2(bank: Any) -> Activation:  # softcap(gate) * sigmoid(gate) * softcap(up), in fp32
    act = bank.act_fn
    if source_key(type(act).forward) != _INKLING2_ACT:
        raise ValueError(f"its activation {type(act).__name__} is not Inkling 2's softcapped SwiGLU")
    gate, up = float(act.gate_softcap.softcap), float(act.up_softcap.softcap)
    return SwiGLUVariant(gate_softcap=gate, up_softcap=up, float32=True)


_DBRX_GLU = "974819a7f9f3680b"  # DbrxExpertGLU.forward: (act(x @ w1.T) * (x @ v1.T)) @ w2


def _dbrx(bank: Any) -> Activation:
    if source_key(type(bank.mlp).forward) != _DBRX_GLU:
        raise ValueError(f"its {type(bank.mlp).__name__} does not compute DbrxExpertGLU's SwiGLU")
    if not is_silu(bank.mlp.activation_fn):
        raise ValueError(f"activation {type(bank.mlp.activation_fn).__name__} is not SiLU")
    return "swiglu"


def _fp32_swiglu(bank: Any) -> Activation:  # Beam's: (act(gate.float()) * up.float()).to(gate.dtype)
    read_silu(bank)
    return SwiGLUVariant(float32=True)


_PARALLEL_EXPERTS = "dff7f5884f1faf5d"  # JetMoeParallelExperts.forward: F.linear per expert, stacked


def _jetmoe(block: Any) -> Activation:  # the block's experts: down(act(gate x) * up x), gate rows first
    for name in ("input_linear", "output_linear"):
        key = source_key(type(getattr(block, name)).forward)
        if key != _PARALLEL_EXPERTS:
            raise ValueError(
                f"its {name} ({type(getattr(block, name)).__name__}) does not compute what "
                f"JetMoeParallelExperts does (source key {key})"
            )
    return silu_of(block.activation)


@dataclass(frozen=True, slots=True)
class BankKind:
    """An experts module read from ``transformers.models.<like>``, recognised by `bank_key` ``key``,
    laid out as ``layout``; ``activation(bank)`` gives what it computes (ValueError naming what
    of this instance cannot be reproduced); without it, ``refusal`` says why no instance can be.
    ``norm``: the bank's per-expert RMS norm of its experts' outputs (``hf_moe_expert_norms``);
    ``own_layout``: the bank keeps ``layout`` in any block that runs it on the routed rows and
    weighs its output (Ergo's, in DeepSeek-V3's block), whatever layout the block kind names."""

    name: str
    like: str
    key: str
    layout: BankLayout
    activation: Callable[[Any], Activation] | None
    refusal: str = ""
    norm: str | None = None
    own_layout: bool = False


BANK_KINDS: tuple[BankKind, ...] = (
    BankKind("SwiGLU", EXPERTS[0], f"{EXPERTS[1]}+fe7a0279de333525", "rows", read_silu),
    BankKind("SwiGLU by columns", EXPERTS_COLUMNS[0], EXPERTS_COLUMNS[1], "columns", read_silu),
    BankKind(
        "clamped SwiGLU, biased",
        EXPERTS_GPT_OSS[0],
        f"{EXPERTS_GPT_OSS[1]}+ab805140cfa99ac9",
        "interleaved",
        lambda bank: ClampedSwiGLU(float(bank.alpha), float(bank.limit)),
    ),
    BankKind(
        "SwiGLU by columns", "aria.AriaExperts", "2bac229b72d0c9b1+fe7a0279de333525", "columns", read_silu
    ),
    BankKind("clamped SwiGLU", "hy_v4.HYV4Experts", "51563666960dd0ee+19e627b406100f22", "rows", _hy_v4),
    BankKind(
        "clamped SwiGLU",
        "deepseek_v4.DeepseekV4Experts",
        "51563666960dd0ee+f7dbc36f891706f9",
        "rows",
        read_deepseek_v4,
    ),
    BankKind(
        "clamped SwiGLU (GPT-OSS's)",
        "minimax_m3_vl.MiniMaxM3VLExperts",
        "51563666960dd0ee+c2e7357b81ee8bcf",
        "rows",
        read_minimax_m3,
    ),
    BankKind(
        "SwiGLU clipped after the activation",
        "bailing_hybrid.BailingHybridExperts",
        "51563666960dd0ee+e7a8e4312b0af4ca",
        "rows",
        _bailing,
    ),
    BankKind(
        "softcapped SwiGLU",
        "inkling2.Inkling2Experts",
        "51ff742e12b1e71b+5b8aa87d557059e7",
        "rows",
        _inkling2,
    ),
    BankKind(
        "ReLU², not gated",
        "nemotron_h.NemotronHExperts",
        "8fb65733b1818828+fe7a0279de333525",
        "up_rows",
        read_relu2,
    ),
    BankKind("SwiGLU, flat", "dbrx.DbrxExperts", "96c13de2312a5fad", "flat_rows", _dbrx),
    BankKind(  # up_proj [E, d, h] @ relu2 @ down_proj [E, h, d], then each expert's own RMS norm
        "ReLU², normalised per expert",
        "ergo.ErgoExperts",
        "9e5d95cd8c06579e+fe7a0279de333525",
        "up_columns",
        read_relu2,
        norm="post_expert_norm",
        own_layout=True,
    ),
    BankKind("SwiGLU in fp32", "beam.BeamExperts", "51563666960dd0ee+749303c3628399ed", "rows", _fp32_swiglu),
    # JetMoE's experts sit on the block (`bank_module`), read by its forward, which runs them
    BankKind("SwiGLU, parallel experts", "jetmoe.JetMoeMoE", "6f3612ddbc63a69e", "parallel_experts", _jetmoe),
)

# the layouts read and written through their `bank_parts` alone (the fused banks' bands are cut by hand)
PART_LAYOUTS: tuple[BankLayout, ...] = ("up_rows", "flat_rows", "parallel_experts", "up_columns")


@dataclass(frozen=True, slots=True)
class BankReading:
    """A bank in ``tessera.moe``'s terms: ``experts`` experts ``d_model -> hidden -> d_model``
    computing ``activation``; ``norm``: its per-expert norm's weight (relative to the block) and
    epsilon ``norm_eps``."""

    kind: BankKind
    experts: int
    d_model: int
    hidden: int
    activation: Activation
    norm: str | None = None
    norm_eps: float | None = None


def _dims(bank: Any, layout: BankLayout) -> tuple[int, int, int]:
    """``(experts, d_model, hidden)`` of ``bank`` laid out as ``layout``."""
    if layout == "flat_rows":
        return int(bank.num_experts), int(bank.mlp.w1.shape[1]), int(bank.ffn_hidden_size)
    if layout == "up_rows":
        e, h, d = bank.up_proj.shape
        return int(e), int(d), int(h)
    if layout == "up_columns":
        e, d, h = bank.up_proj.shape
        return int(e), int(d), int(h)
    if layout == "parallel_experts":
        e, two_h, d = bank.input_linear.weight.shape
        if tuple(bank.output_linear.weight.shape) != (e, d, two_h // 2) or two_h % 2:
            raise ValueError(
                f"its input_linear.weight {tuple(bank.input_linear.weight.shape)} and output_linear.weight "
                f"{tuple(bank.output_linear.weight.shape)} are not [E, 2h, d] and [E, d, h]"
            )
        return int(e), int(d), int(two_h) // 2
    e, a, b = bank.gate_up_proj.shape
    return (int(e), int(b), int(a) // 2) if layout == "rows" else (int(e), int(a), int(b) // 2)


def bank_module(block: nn.Module, layout: BankLayout) -> nn.Module:
    """The module of ``block`` holding its experts' tensors as ``layout`` lays them out: the
    block itself for ``parallel_experts`` (JetMoE), else its ``experts``."""
    return block if layout == "parallel_experts" else block.get_submodule("experts")


def read_bank(bank: nn.Module, layout: BankLayout) -> BankReading:
    """``bank`` as a kind of ``layout`` reads it; ValueError naming the class when no kind of that
    layout computes what its forward computes, or what of this instance cannot be reproduced."""
    key = bank_key(type(bank))
    kinds = [k for k in BANK_KINDS if k.layout == layout]
    known = next((k for k in BANK_KINDS if k.key == key), None)
    if known is not None and known.activation is None:
        raise ValueError(known.refusal)
    kind = next((k for k in kinds if k.key == key), None)
    if kind is None or kind.activation is None:
        likes = ", ".join(k.like for k in kinds)
        raise ValueError(
            f"its experts {type(bank).__name__} do not compute what {likes} computes (source key {key})"
        )
    activation = kind.activation(bank)
    experts, d_model, hidden = _dims(bank, layout)
    if kind.norm is None:
        return BankReading(kind, experts, d_model, hidden, activation)
    norm, eps = read_norm(bank, kind.norm, EXPERT_NORM, (experts, d_model))
    return BankReading(kind, experts, d_model, hidden, activation, f"experts.{norm}", eps)


def bank_layout(bank: nn.Module, layout: BankLayout) -> BankLayout:
    """The layout to read ``bank`` by in a block whose kind names ``layout``: the bank kind's own
    where it keeps it (`BankKind`'s ``own_layout``), else ``layout``."""
    key = bank_key(type(bank))
    own = next((k for k in BANK_KINDS if k.key == key and k.own_layout), None)
    return layout if own is None else own.layout


def holds_bank(bank: Any) -> bool:
    """Whether ``bank`` holds its experts' tensors as one of the `BankLayout` s does."""

    def tensors(owner: Any, *names: str) -> bool:
        return all(isinstance(getattr(owner, n, None), Tensor) for n in names)

    return isinstance(bank, nn.Module) and (
        tensors(bank, "gate_up_proj", "down_proj")
        or tensors(bank, "up_proj", "down_proj")
        or tensors(getattr(bank, "mlp", None), "w1", "v1", "w2")
    )


def holds_parallel_experts(block: Any) -> bool:
    """Whether ``block`` holds JetMoE's gated experts itself: ``input_linear.weight [E, 2h, d]``
    and ``output_linear.weight [E, d, h]``. JetMoE's mixture of attention heads (``JetMoeMoA``)
    holds the same two tensors as ``[E, a, d]`` and ``[E, d, a]`` (query projections, not
    gated: ``a`` rows in, ``a`` columns out) and is no block (its attention calls its ``map`` and
    ``reduce``; its forward raises): it is not one."""
    into, out = (getattr(getattr(block, n, None), "weight", None) for n in ("input_linear", "output_linear"))
    if not (isinstance(into, Tensor) and isinstance(out, Tensor) and into.dim() == out.dim() == 3):
        return False
    (e, rows, d), (e_out, d_out, h) = into.shape, out.shape
    return bool(e == e_out and rows == 2 * h and d == d_out)


def _gate_up_bands(layout: BankLayout, h: int) -> tuple[Band, Band]:
    """Where gate and up sit in HF's fused ``gate_up_proj`` as ``layout`` lays it out: rows
    ``0:h`` and ``h:2h`` of ``[E, 2h, d]``, columns ``0:h`` and ``h:2h`` of ``[E, d, 2h]``, or
    its even and odd columns (``interleaved``; its bias ``[E, 2h]`` alike)."""
    if layout == "interleaved":
        return Band(-1, 0, 2 * h, 2), Band(-1, 1, 2 * h, 2)
    dim = -1 if layout == "columns" else -2
    return Band(dim, 0, h), Band(dim, h, 2 * h)


def bank_parts(
    layout: BankLayout, experts: int, hidden: int, norm: str | None = None
) -> dict[str, tuple[ExportPart, ...]]:
    """The bank's tensors (``experts.w1``, ...; names relative to the block) as parts of HF's:
    the fused banks' ``w1`` / ``w3`` the gate / up band of ``experts.gate_up_proj`` (`_gate_up_bands`)
    and ``w2`` ``experts.down_proj``, transposed where they are rows (Mixtral's), GPT-OSS's biases
    ``b1`` / ``b3`` / ``b2`` the same bands of ``gate_up_proj_bias`` and ``down_proj_bias``; and for
    the `PART_LAYOUTS`: Nemotron-H's ``w1 = up_proj`` and ``w2 = down_proj``, each transposed;
    DBRX's ``w1`` / ``w3`` expert ``e`` the rows ``e*h:(e+1)*h`` of ``mlp.w1`` / ``mlp.v1``,
    transposed, and ``w2`` those of ``mlp.w2`` as they are; JetMoE's ``w1`` / ``w3`` the rows
    ``0:h`` / ``h:2h`` of ``input_linear.weight``, ``w2`` ``output_linear.weight``, transposed."""
    if norm is not None and layout != "up_columns":
        raise ValueError(f"a per-expert norm ({norm}) is read with the up_columns layout, not {layout!r}")
    normed = {} if norm is None else {"experts.norm": (ExportPart(norm),)}  # Ergo's, ``[E, d]`` as it is
    if layout in ("rows", "columns", "interleaved"):
        gate, up = _gate_up_bands(layout, hidden)
        rows = layout == "rows"  # Mixtral's [E, 2h, d]: nn.Linear's layout, transposed
        fused: dict[str, tuple[ExportPart, ...]] = {
            "experts.w1": (ExportPart("experts.gate_up_proj", transpose=rows, band=gate),),
            "experts.w3": (ExportPart("experts.gate_up_proj", transpose=rows, band=up),),
            "experts.w2": (ExportPart("experts.down_proj", transpose=rows),),
        }
        if layout != "interleaved":
            return fused
        return {  # GPT-OSS's biases, laid out as its weights' columns
            **fused,
            "experts.b1": (ExportPart("experts.gate_up_proj_bias", band=gate),),
            "experts.b3": (ExportPart("experts.gate_up_proj_bias", band=up),),
            "experts.b2": (ExportPart("experts.down_proj_bias"),),
        }
    if layout == "up_rows":
        return {
            "experts.w1": (ExportPart("experts.up_proj", transpose=True),),
            "experts.w2": (ExportPart("experts.down_proj", transpose=True),),
        }
    if layout == "up_columns":  # Ergo's: as tessera.moe holds them
        return {
            "experts.w1": (ExportPart("experts.up_proj"),),
            "experts.w2": (ExportPart("experts.down_proj"),),
            **normed,
        }
    if layout == "flat_rows":

        def per_expert(name: str, transpose: bool) -> tuple[ExportPart, ...]:
            return tuple(
                ExportPart(name, index=e, transpose=transpose, band=Band(-2, e * hidden, (e + 1) * hidden))
                for e in range(experts)
            )

        return {
            "experts.w1": per_expert("experts.mlp.w1", True),
            "experts.w3": per_expert("experts.mlp.v1", True),
            "experts.w2": per_expert("experts.mlp.w2", False),
        }
    if layout == "parallel_experts":
        return {
            "experts.w1": (ExportPart("input_linear.weight", transpose=True, band=Band(-2, 0, hidden)),),
            "experts.w3": (
                ExportPart("input_linear.weight", transpose=True, band=Band(-2, hidden, 2 * hidden)),
            ),
            "experts.w2": (ExportPart("output_linear.weight", transpose=True),),
        }
    raise ValueError(f"bank layout {layout!r} is not a BankLayout")


def read_parts(block: nn.Module, parts: tuple[ExportPart, ...]) -> Tensor:
    """The trained tensor made of ``parts`` of ``block``'s tensors (names relative to it)."""
    return assemble(parts, [block.get_parameter(p.name) for p in parts])
