"""Positions that follow the sequence shards: each rank's tokens get their global positions.

Under context parallelism a rank holds ``local_len`` tokens of a sequence of ``cp *
local_len`` (contiguous, or zigzag chunks ``r`` and ``2*cp-1-r``), but the model computes
positions from its local length. A *positions module* is one whose output is indexed by
sequence position; ``follow_positions`` hooks it in one of two ways, chosen per call:

- called with position ids (an integer tensor, or a ``position_ids`` keyword: a learned
  position embedding, a Hugging Face rotary embedding): the ids ``0..local_len-1`` become
  this rank's global positions (ids outside that range raise ValueError);
- called with an activation and no ids (``rotary(x)`` with ``x`` (batch, seq, ...), like
  ``tessera.models.foreign.Rotary``): it runs on ``x`` expanded to the global length (no
  copy; the module may read only the shape, dtype and device of ``x``) and each output tensor
  is indexed at this rank's global positions along dim -2 (its sequence dim: (seq, dim),
  (batch, seq, dim), (batch, 1, seq, dim)).

``find_positions`` autodetects modules that are safe to hook: a parameter-free leaf module
whose class name says rotary (``Rotary``, ``RotaryEmbedding``, ``RoPE``; not an attention
that applies rotary inside), and the learned position embeddings of
Hugging Face models (``wpe``, ``position_embeddings``, ``embed_positions``).
``guard_embeddings`` catches the rest where it can: an ``nn.Embedding`` that is not hooked
and is called with exactly ``arange(local_len)`` on every row is a position embedding left
behind, and raises ValueError naming it. A model that builds its positions elsewhere (slices
a cos/sin buffer by ``[:seq]`` inside a module that also does other work) cannot be made to
follow automatically: move that computation into a module and name it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from tessera.comm import Group, group_rank, group_size
from tessera.tensor_parallel.context.layout import Layout, local_positions
from tessera.tensor_parallel.plan import match_pattern

__all__ = ["find_positions", "follow_positions", "guard_embeddings"]

_ROTARY = re.compile(r"[Rr]otary|RoPE|Rope(?:Embedding)?$")
_HF_LEARNED = ("wpe", "position_embeddings", "embed_positions")


def _is_hf(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def find_positions(model: nn.Module, patterns: str | None = None) -> list[tuple[str, nn.Module]]:
    """The positions modules of ``model``: those matching the comma-separated plan-style
    ``patterns`` (each must match one at least; ValueError otherwise), and the autodetected
    ones (see the module docstring). Never a module inside another one found."""
    named = [(n, m) for n, m in model.named_modules() if n]
    found: dict[str, nn.Module] = {}
    for pattern in [p.strip() for p in (patterns or "").split(",") if p.strip()]:
        hits = [(n, m) for n, m in named if match_pattern(pattern, n)]
        if not hits:
            raise ValueError(f"positions pattern {pattern!r} matches no module of {type(model).__name__}")
        found.update(hits)
    for name, module in named:
        hf_learned = isinstance(module, nn.Embedding) and name.rpartition(".")[2] in _HF_LEARNED
        leaf = next(module.children(), None) is None and next(module.parameters(), None) is None
        if (leaf and _ROTARY.search(type(module).__name__)) or (hf_learned and _is_hf(model)):
            found.setdefault(name, module)
    kept = sorted(found)
    return [(n, found[n]) for n in kept if not any(n.startswith(o + ".") for o in kept if o != n)]


def _ids_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | str, Tensor] | None:
    """Where the position ids of a call are: a ``position_ids`` keyword or the first integer
    tensor argument."""
    ids = kwargs.get("position_ids")
    if isinstance(ids, Tensor):
        return "position_ids", ids
    for i, a in enumerate(args):
        integer = isinstance(a, Tensor) and not (a.is_floating_point() or a.is_complex())
        if integer and a.dtype != torch.bool:
            return i, a
    return None


class _Follow:
    """The pre- and post-hook of one positions module (see the module docstring)."""

    def __init__(self, name: str, cp: int, rank: int, layout: Layout) -> None:
        self.name, self.cp, self.rank, self.layout = name, cp, rank, layout

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        where = _ids_of(args, kwargs)
        if where is not None:
            key, ids = where
            n = ids.shape[-1]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise ValueError(
                    f"positions module {self.name} was called with ids in [{int(ids.min())}, "
                    f"{int(ids.max())}]; under context parallelism it expects local positions 0..{n - 1} "
                    "(let the model compute them: do not pass global position ids)"
                )
            mapped = local_positions(self.rank, self.cp, n, self.layout, ids.device)[ids]
            if isinstance(key, str):
                return args, {**kwargs, key: mapped}
            return (*args[:key], mapped, *args[key + 1 :]), kwargs
        if not args or not isinstance(args[0], Tensor) or args[0].dim() < 2:
            raise ValueError(
                f"positions module {self.name} was called without position ids or a (batch, seq, ...) tensor"
            )
        x = args[0]
        shape = list(x.shape)
        shape[1] *= self.cp
        return (x.narrow(1, 0, 1).expand(shape), *args[1:]), kwargs

    def post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if _ids_of(args, kwargs) is not None:
            return out
        total = args[0].shape[1]
        index = local_positions(self.rank, self.cp, total // self.cp, self.layout, args[0].device)

        def take(t: Any) -> Any:
            if not isinstance(t, Tensor):
                return t
            if t.dim() < 2 or t.shape[-2] != total:
                raise ValueError(
                    f"positions module {self.name} returned shape {tuple(t.shape)} for a sequence of "
                    f"{total}: its dim -2 should be the sequence"
                )
            return t.index_select(-2, index.to(t.device))

        return type(out)(take(t) for t in out) if isinstance(out, (tuple, list)) else take(out)


def follow_positions(
    modules: list[tuple[str, nn.Module]], group: Group, layout: Layout | str
) -> list[RemovableHandle]:
    """Hook each (name, module) so its positions are this rank's global ones; the handles."""
    cp, rank, layout = group_size(group), group_rank(group), Layout(layout)
    handles = []
    for name, module in modules:
        follow = _Follow(name, cp, rank, layout)
        handles.append(module.register_forward_pre_hook(follow.pre, with_kwargs=True))
        handles.append(module.register_forward_hook(follow.post, with_kwargs=True))
    return handles


def _guard(name: str, module: nn.Module) -> RemovableHandle:
    def check(mod: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args and isinstance(args[0], Tensor) else None
        if ids is not None and ids.dim() >= 1 and ids.shape[-1] > 1:
            ar = torch.arange(ids.shape[-1], device=ids.device, dtype=ids.dtype)
            if bool((ids == ar).all()):
                raise ValueError(
                    f"{name} looks like a position embedding (called with 0..{ids.shape[-1] - 1}) but "
                    "does not follow the sequence shards: name it in positions= (ModelSpec.positions)"
                )
        handle.remove()

    handle = module.register_forward_pre_hook(check)
    return handle


def guard_embeddings(model: nn.Module, hooked: list[tuple[str, nn.Module]]) -> list[RemovableHandle]:
    """On its first call, an ``nn.Embedding`` not in ``hooked`` that is called with
    ``arange(local_len)`` (local_len > 1) on every row raises ValueError naming it."""
    skip = {id(m) for _, m in hooked}
    return [
        _guard(name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding) and id(module) not in skip
    ]
