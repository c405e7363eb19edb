"""A survey, not a test: every mixture-of-experts causal-LM family of the installed
``transformers`` against ``tessera.launcher.families.hf_moe``. Prints one table, a row per
family: whether it builds at a tiny size, whether its sparse block has the layout
``moe_from_hf`` reads (a ``gate`` or ``router`` beside ``experts.gate_up_proj [E, 2h, d]`` and
``experts.down_proj [E, d, h]``, or by columns ``[E, d, 2h]`` and ``[E, h, d]``, or not gated
``up_proj`` / ``down_proj``, or DBRX's flat ``mlp.w1`` / ``v1`` / ``w2``), its routing
(scores; group-limited ``n_group`` / ``topk_group``; a score-correction bias; a routed scale;
``norm_topk_prob``; shared experts, how many and whether gated; expert biases; the experts'
activation), and the outcome:
``same logits`` (converted, and the converted model's logits equal the original's to rtol and
atol 1e-5), ``DIFFERENT`` (converted, but not equal: the worst case), or why it was refused.

    hatch run python tests/survey_hf_moe.py [model_type ...]

A family is one whose config counts experts (``num_experts``, ``num_local_experts``,
``n_routed_experts``, ...). Each is ``tessera.launcher.testing_hf_moe``'s tiny model of it
(2 layers, hidden 32, 8 experts of width 16, top-2, every weight and score-correction bias
drawn from a seeded normal), the one the tests train. The routing columns come from
``hf_moe_routing.read_layout`` where it reads the block, else from the router's attributes and
source (marked ``~``). The logits are compared in training mode (no dropout), as the converted
model trains, each forward after ``torch.manual_seed(0)`` (PhiMoE's kept router samples). 10 s on
a 2-core machine.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any

import torch
from torch import nn

from tessera.launcher.families.hf_moe import convert_hf_moe, is_hf_sparse_moe
from tessera.launcher.families.hf_moe_routing import HFLayout, read_layout
from tessera.launcher.testing_hf_moe import moe_families
from tessera.launcher.testing_hf_moe import tiny_moe_model as build

SHARED_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "num_shared_expert")
TOL = 1e-5


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse blocks ``moe_from_hf`` reads, else the modules holding an ``experts`` bank
    (JetMoE's attention holds one too, its mixture the experts' tensors itself)."""
    read = [m for m in model.modules() if is_hf_sparse_moe(m)]
    return read or [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def _bank(block: nn.Module) -> Any:
    """The module holding ``block``'s experts' tensors: its ``experts``, or itself (JetMoE's)."""
    bank = getattr(block, "experts", None)
    return bank if isinstance(bank, nn.Module) else block


def _layout_ok(block: nn.Module) -> str:
    """``yes`` when ``block`` has the layout ``moe_from_hf`` reads, else ``no`` and what it has."""
    bank = _bank(block)
    if not is_hf_sparse_moe(block):
        names = ", ".join(n for n, _ in bank.named_parameters())
        return f"no ({names or type(bank).__name__})"
    if bank is block:  # JetMoE's input_linear (gate and up rows) and output_linear
        return "yes, parallel experts"
    if not hasattr(bank, "gate_up_proj"):  # Nemotron-H's non-gated up_proj, DBRX's mlp.w1 / v1 / w2
        return "yes, not gated" if hasattr(bank, "up_proj") else "yes, flat (mlp.w1, v1, w2)"
    gate_up, down = bank.gate_up_proj, bank.down_proj
    if gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]:
        return "yes"
    if gate_up.shape[2] == 2 * down.shape[1] and gate_up.shape[1] == down.shape[2]:
        return "yes, by columns"  # gate_up [E, d, 2h], down [E, h, d]: Llama 4's, GPT-OSS's
    return f"no (gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)})"


def _from_layout(layout: HFLayout, config: Any) -> dict[str, str]:
    spec = layout.routing
    shared = "-"
    if layout.shared is not None:  # as many as the config says, fused into one MLP this wide
        count = _first(config, SHARED_COUNTS) or 1
        shared = f"{count} ({layout.shared_hidden}w)" + (" gated" if layout.shared_gate else "")
    return {
        "score": spec.score,
        "groups": f"{spec.top_groups}/{spec.groups} {spec.group_score}" if spec.groups > 1 else "-",
        "bias": "yes" if spec.choice_bias else "-",
        "scale": f"{spec.scale:g}" if spec.scale != 1 else "-",
        "norm": "yes" if layout.renormalize else "no",
        "shared": shared,
    }


def _first(obj: Any, names: tuple[str, ...]) -> Any:
    return next((getattr(obj, n) for n in names if getattr(obj, n, None) is not None), None)


def _guessed(block: nn.Module, config: Any) -> dict[str, str]:
    """Routing features read from the router's attributes and source (no reader knows it)."""
    router = _first(block, ("gate", "router"))
    try:
        src = inspect.getsource(type(router).forward) if router is not None else ""
    except (OSError, TypeError):
        src = ""
    score = "sigmoid" if "sigmoid" in src else "softmax" if "softmax" in src else "?"
    groups = _first(router, ("num_group", "n_group")) or getattr(config, "n_group", None)
    top = _first(router, ("topk_group",)) or getattr(config, "topk_group", None)
    tensors = {n for n, _ in block.named_parameters()} | {n for n, _ in block.named_buffers()}
    bias = any("bias" in n and "experts" not in n and "proj" not in n for n in tensors)
    scale = _first(router, ("routed_scaling_factor", "route_scale", "router_scaling_factor"))
    scale = scale if scale is not None else _first(block, ("routed_scaling_factor",))
    norm = _first(router, ("norm_topk_prob",))
    shared_module = _first(block, ("shared_expert", "shared_experts", "shared_mlp"))
    count = _first(config, SHARED_COUNTS)
    gated = " gated" if hasattr(block, "shared_expert_gate") else ""
    shared = "-" if shared_module is None else f"{count or 1}{gated}"
    return {
        "score": f"~{score}",
        "groups": f"~{top}/{groups}" if groups and int(groups) > 1 else "-",
        "bias": "~yes" if bias else "-",
        "scale": f"~{scale:g}" if isinstance(scale, float) and scale != 1 else "-",
        "norm": "?" if norm is None else f"~{'yes' if norm else 'no'}",
        "shared": f"~{shared}",
    }


def survey(kind: str) -> dict[str, str]:
    row = {"family": kind}
    try:
        model = build(kind)
    except Exception as exc:
        return {
            **row,
            "builds": "no",
            "result": f"not built: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}",
        }
    row["builds"] = "yes"
    blocks = _blocks(model)
    if not blocks:
        return {**row, "result": "no experts module found"}
    block = blocks[0]
    row["layout"] = _layout_ok(block)
    bank = _bank(block)
    row["exp.bias"] = "yes" if any("bias" in n for n, _ in bank.named_parameters()) else "-"
    act = getattr(bank, "act_fn", None)
    row["act"] = type(act).__name__.removesuffix("Activation") if act is not None else "?"
    if act is None and hasattr(bank, "limit") and hasattr(bank, "alpha"):  # GPT-OSS's
        row["act"] = "clamped SwiGLU"
    try:
        row |= _from_layout(read_layout(block), getattr(model, "config", None))
    except ValueError:
        row |= _guessed(block, getattr(model, "config", None))
    if not is_hf_sparse_moe(block):
        return {**row, "result": "not converted: not the layout moe_from_hf reads"}
    converted = copy.deepcopy(model)
    try:
        count = convert_hf_moe(converted)
    except ValueError as exc:
        return {**row, "result": f"refused: {_reason(str(exc))}"}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        try:
            torch.manual_seed(0)  # the same draws for a router kept as written that samples (PhiMoE's)
            want = model(ids, use_cache=False).logits
        except Exception as exc:
            return {**row, "result": f"converted; the original does not run here: {type(exc).__name__}"}
        torch.manual_seed(0)
        got = converted(ids, use_cache=False).logits
    if torch.allclose(got, want, rtol=TOL, atol=TOL):
        return {**row, "result": f"same logits ({count} MoE layers)"}
    return {**row, "result": f"DIFFERENT (max |diff| {float((got - want).abs().max()):.2g})"}


def _reason(message: str) -> str:
    """A refusal's reason without the names of the model, the module and the class before it."""
    reason = message.split(": ", 2)[-1]
    if "has a forward tessera.moe has no reading" in reason:
        return reason.split(" (source key")[0].replace(
            " has a forward tessera.moe has no reading of", ": unknown forward"
        )
    return reason[:150]


COLUMNS = [
    "family",
    "builds",
    "layout",
    "score",
    "groups",
    "bias",
    "scale",
    "norm",
    "shared",
    "exp.bias",
    "act",
    "result",
]


def main(kinds: list[str]) -> None:
    rows = [survey(kind) for kind in kinds]
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in COLUMNS[:-1]}
    line = " | ".join(c.ljust(widths[c]) for c in COLUMNS[:-1]) + " | result"
    print(line)
    print("-" * len(line))
    for r in rows:
        print(" | ".join(r.get(c, "").ljust(widths[c]) for c in COLUMNS[:-1]) + " | " + r.get("result", ""))
    converted = sum(r.get("result", "").startswith("same logits") for r in rows)
    print(f"\n{len(rows)} MoE families; {converted} converted with the same logits")


if __name__ == "__main__":
    main(sys.argv[1:] or moe_families())
