"""Prove, before converting, that an attention module's tp shards add up to the module, and
that another region's (an MLP's) do.

A region (``region``) is read as "its column-parallel layers in, its row-parallel layer out":
the sum over the ranks of what each computes with its shards is the module's output. A module
that does more around its dense layers (a norm beside them, a gate on its input) is not, and
splitting it trains silently wrong; the first region of each class is run per rank on one
random input as below, and refused when the shares do not add up to it.

``parallelize`` splits an ``attention`` module's projections by heads and divides its
head-count attributes (``num_heads``, ``heads``, ``split_size``, ...) by tp, so that code
reading them sees one rank's share. That is right for a module that reshapes by its head
count and a fixed head width (``view(b, t, self.heads, self.head_dim)``), and silently wrong
for one that derives a width from the count and its *input* (``x.shape[-1] // self.heads``).
Which one a module is cannot be read from it, so it is measured: for the first attention
module of each class, every rank's shard is built locally on a copy (the projections' own
slices, the attributes as ``RegionStyle.localize`` sets them, the output bias on one copy),
the copies run on one random input, and their outputs' sum must equal the serial module's.
A head count read from the module's ``config`` (Hugging Face) is covered too: ``localize``
gives the module a config copy with one rank's counts, and the probe runs with it.
Hugging Face attention takes more than the hidden states: a forward with a
``position_embeddings`` parameter gets random rotary ``(cos, sin)``, each (batch, tokens,
head_dim), and a required ``attention_mask`` gets None (no mask: the module's own causal
flag, or none, applies to the whole and the shares alike). Pure: nothing is communicated and
the model is not touched; a module needing any other argument is not probed (logged at debug).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tessera.tensor_parallel.heads import GROUP_ATTRIBUTES, KV_HEAD_ATTRIBUTES
from tessera.tensor_parallel.layers import dense_weights, is_dense
from tessera.tensor_parallel.plan import Assignment
from tessera.tensor_parallel.probing import evaluating, first_tensor
from tessera.tensor_parallel.region_style import PER_RANK_ATTRIBUTES, RegionStyle
from tessera.tensor_parallel.style import Role

__all__ = ["probe_attention"]

log = logging.getLogger(__name__)
# of the largest output (whole or one rank's): fp32 sums over tp in another order (~1e-6 seen);
# in half precision each rank's output is rounded before the sum: 8 epsilons of the dtype.
# A head width read wrong moves outputs by about their own size (0.5 relative measured).
_RTOL = 1e-4
_TOKENS = 4


def probe_attention(model: nn.Module, assignments: list[Assignment], *, tp: int) -> None:
    """ValueError naming the module if the first attention module of a class, or the first
    other region (an MLP), split over ``tp`` as the plan says, would not compute what it
    computes whole."""
    if tp == 1:
        return
    inner: dict[str, dict[str, Assignment]] = {}
    attention = [a for a in assignments if isinstance(a.style, RegionStyle)]
    for a in attention:
        inner[a.name] = {b.name[len(a.name) + 1 :]: b for b in assignments if b.name.startswith(a.name + ".")}
    seen: set[type] = set()
    for a in attention:
        module = model.get_submodule(a.name)
        if type(module) in seen:
            continue
        seen.add(type(module))
        _probe(module, a, inner[a.name], tp)


def _input_width(module: nn.Module, inner: Mapping[str, Assignment]) -> int | None:
    for child, b in inner.items():
        sub = module.get_submodule(child)
        if b.style.role is Role.ENTER and is_dense(sub):
            return int(dense_weights(sub)[0].shape[1])
    return None


@contextlib.contextmanager
def _as_rank(
    module: nn.Module, style: RegionStyle, inner: Mapping[str, Assignment], rank: int, tp: int, name: str
) -> Iterator[list[str]]:
    """``module`` holding rank ``rank``'s share (its projections' slices as plain dense layers,
    its attributes as ``localize`` sets them) inside the block, exactly as it was after. In place,
    not on a copy: a forward patched on the instance (a closure) still sees this module."""
    params: list[tuple[nn.Module, str, nn.Parameter]] = []
    attrs: list[tuple[nn.Module, str, Any]] = []
    try:
        for attr in (*PER_RANK_ATTRIBUTES, *KV_HEAD_ATTRIBUTES, *GROUP_ATTRIBUTES):
            if isinstance(getattr(module, attr, None), int):
                attrs.append((module, attr, getattr(module, attr)))
        if hasattr(module, "config"):
            attrs.append((module, "config", module.config))  # localize may give it its own copy
        # an attention's head counts to one rank's share (it reads the whole projections' widths)
        changed = style.localize(module, name=name, tp=tp) if style.attention else []
        for child, b in inner.items():
            sub = module.get_submodule(child)
            for pname, param in list(sub.named_parameters(recurse=False)):
                spec = b.style.shard_spec(sub, pname)
                if spec is not None:
                    part = spec.shard(param.detach(), rank, tp)
                    part = part.t() if spec.transposed else part  # back to the layer's own layout
                elif b.style.role is Role.EXIT and pname == "bias" and rank > 0:
                    part = torch.zeros_like(param)  # a row-parallel layer adds its bias once
                else:
                    continue
                params.append((sub, pname, param))
                setattr(sub, pname, nn.Parameter(part.contiguous(), requires_grad=False))
            if hasattr(sub, "nf") and is_dense(sub) and not isinstance(sub, nn.Linear):
                attrs.append((sub, "nf", sub.nf))  # HF Conv1D shapes its output by nf
                setattr(sub, "nf", int(dense_weights(sub)[0].shape[0]))  # noqa: B010 - an int, not a Module
        yield changed
    finally:
        for sub, pname, param in reversed(params):
            setattr(sub, pname, param)
        for owner, attr, value in reversed(attrs):
            setattr(owner, attr, value)


def _call_keywords(
    module: nn.Module, style: RegionStyle, name: str, like: Tensor, gen: torch.Generator
) -> dict[str, Any] | None:
    """The keyword arguments besides the hidden states that ``module``'s forward takes (see the
    module docstring); None when it needs one the probe cannot make."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for p in params:
        if p.name == "position_embeddings":
            head_dim = style.layout(module, name=name).head_dim
            if head_dim is None:
                return None
            angles = torch.rand(2, _TOKENS, head_dim, generator=gen, dtype=torch.float64) * 6.3
            out[p.name] = (angles.cos().to(like.device, like.dtype), angles.sin().to(like.device, like.dtype))
        elif p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        elif p.name == "attention_mask":
            out[p.name] = None
        else:
            return None
    return out


def _probe(module: nn.Module, a: Assignment, inner: Mapping[str, Assignment], tp: int) -> None:
    assert isinstance(a.style, RegionStyle)
    where = f"{a.name} ({a.style.name})"
    params = list(module.parameters())
    width = _input_width(module, inner)
    if width is None or not params or any(p.is_meta for p in params):
        return
    like = params[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, _TOKENS, width, generator=gen, dtype=torch.float64).to(like.device, like.dtype)
    kwargs = _call_keywords(module, a.style, a.name, like, gen)
    if kwargs is None:
        log.debug("probe: %s not probed (its forward needs arguments the probe cannot make)", where)
        return
    with evaluating(module):
        try:
            want = first_tensor(module(x, **kwargs))
        except Exception as exc:  # it needs more than a tensor: not probed
            log.debug("probe: %s not probed (%s: %s)", where, type(exc).__name__, exc)
            return
        if want is None:
            return
        total = torch.zeros_like(want, dtype=torch.float64)
        scale = float(want.abs().max())
        changed: list[str] = []  # the attributes localize sets (the same on every rank)
        for rank in range(tp):
            with _as_rank(module, a.style, inner, rank, tp, a.name) as names:
                changed = names
                try:
                    got = first_tensor(module(x, **kwargs))
                except Exception as exc:
                    raise ValueError(
                        f"{where}: split over tp={tp}, {type(module).__name__} fails on rank {rank}'s "
                        f"share ({type(exc).__name__}: {exc}); {_advice(changed)}"
                    ) from exc
            if got is None or got.shape != want.shape:
                shape = None if got is None else tuple(got.shape)
                raise ValueError(
                    f"{where}: rank {rank}'s share returns {shape}, the module {tuple(want.shape)}"
                )
            total += got
            scale = max(scale, float(got.abs().max()))
    half = want.dtype not in (torch.float32, torch.float64)
    rtol = max(_RTOL, 8 * torch.finfo(want.dtype).eps) if half else _RTOL
    diff = float((total - want).abs().max())
    if diff > rtol * max(scale, 1e-30):
        advice = _advice(changed) if a.style.attention else _REGION_ADVICE
        raise ValueError(
            f"{where}: split over tp={tp}, the shards of {type(module).__name__} do not add up to it "
            f"(largest difference {diff:.3g} on outputs up to {scale:.3g}); {advice}"
        )


_REGION_ADVICE = (
    "its output is not the sum of what its column- and row-parallel layers compute on each rank "
    "(it does more around them: a norm, a gate or a residual of its own); keep it whole (plan entry "
    "'replicate') or give its parts their own entries"
)


def _advice(changed: list[str]) -> str:
    attrs = ", ".join(changed) if changed else "none"
    return (
        f"parallelize sets the attributes {attrs} to one rank's share: a forward that derives a head "
        "width from them and its input (x.shape[-1] // heads) breaks; read the width from a head_dim "
        "attribute or from the projection's output (q.shape[-1] // heads); a head count it reads from "
        "anywhere else (another object shared with other modules) stays whole and breaks too"
    )
