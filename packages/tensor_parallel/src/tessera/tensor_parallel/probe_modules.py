"""Prove, before converting, that every module a style splits is computed by its shards.

A style that splits a module's parameters replaces the module by a parallel layer (or, in
2D/2.5D/3D, re-parameterizes it) that computes the plain operation of the module's kind on
the shards: a linear map (``nn.Linear``, HF ``Conv1D``), a lookup (``nn.Embedding``, times the
scale the parallel embeddings carry: ``VocabParallelEmbedding.scale_of``), a layer norm
(``nn.LayerNorm``). What the module's own forward does beyond that (a scale under another
name, an added constant, an override) is lost, silently. So it is measured: for the first
module of each (class, style) pair, each tp rank's share is built locally from the style's
``shard_spec`` (the serial indices each rank's shard holds along each dim), computed as the
parallel layer computes it (``x[..., in] @ W_block^T`` into the rank's output features; the
rank's vocabulary rows looked up, zeros elsewhere, scaled, into its hidden features;
``embedding.vocab_share``), the shares are reassembled (summed into place; what several
ranks hold as copies, a replicated KV head or a 2.5D depth layer, once), and the
result must equal the module called through its own forward on the same random input
(floats for dense layers and norms, ids drawn over the whole vocabulary for embeddings).
Pure: nothing is communicated and the model is not touched. Any tp mode: the 2D/2.5D/3D
styles split the same modules into blocks and are probed the same way.

Not probed (logged at DEBUG): a module on the meta device, one whose forward cannot be called
with one tensor, a module of another kind (a style that splits something else computes
something the probe does not know), a shard that is not a block of the parameter, a spec that
cannot shard yet (2.5D without its depth), and a style saying ``probed = False`` (its
replacement reproduces more than the plain operation: it answers for itself).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.tensor_parallel.embedding import VocabParallelEmbedding, vocab_share
from tessera.tensor_parallel.heads import HeadShardSpec
from tessera.tensor_parallel.layers import dense_weights, is_dense
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.plan import Assignment
from tessera.tensor_parallel.probing import evaluating, first_tensor
from tessera.tensor_parallel.style import TPStyle, module_kind

__all__ = ["ModuleProbe", "probe_modules"]

log = logging.getLogger(__name__)
# of the largest output (whole, reassembled or one rank's share): fp32 sums of the row-parallel
# shares in another order (~1e-7 measured); in half precision each share is rounded before the
# sum: 8 epsilons of the dtype. A forgotten scale or offset moves outputs by their own size.
_RTOL = 1e-4
_ROWS, _TOKENS = 2, 16

Held = tuple[Tensor, ...]
"""Per dim of a parameter, the serial indices one rank's shard holds along it (in its order)."""


@dataclass(frozen=True, slots=True)
class ModuleProbe:
    """What ``probe_modules`` ran: the modules (by name), the largest difference between a
    module's output and its reassembled shares relative to the outputs' magnitude, the seconds."""

    probed: tuple[str, ...]
    largest: float
    seconds: float


class _NotProbed(Exception):
    """The module cannot be probed (why, for the DEBUG log)."""


def probe_modules(model: nn.Module, assignments: list[Assignment], *, tp: int) -> ModuleProbe:
    """ValueError naming the module, its class, the style and what differs if the first module
    of a (class, style) pair, split over ``tp`` as the style says, would not compute what the
    module computes; logs one INFO line (how many, the largest difference, the time)."""
    start = time.perf_counter()
    seen: set[tuple[type, object]] = set()
    probed: list[str] = []
    largest = 0.0
    for a in assignments:
        module = model.get_submodule(a.name)
        key = (type(module), _style_key(a.style))
        if key in seen or not getattr(a.style, "probed", True):
            continue
        specs = {p: a.style.shard_spec(module, p) for p, _ in module.named_parameters(recurse=False)}
        if all(s is None for s in specs.values()):
            continue  # nothing split: the module runs as it is
        seen.add(key)
        try:
            rel = _probe(module, a, specs, tp)
        except _NotProbed as why:
            log.debug("probe: %s (%s) not probed: %s", a.name, a.style.name, why)
            continue
        probed.append(a.name)
        largest = max(largest, rel)
    seconds = time.perf_counter() - start
    log.info(
        "parallelize: probed %d split modules against their shards over tp=%d (%s): largest "
        "difference %.2g of their outputs, %.3f s",
        len(probed),
        tp,
        ", ".join(probed) or "none",
        largest,
        seconds,
    )
    return ModuleProbe(tuple(probed), largest, seconds)


def _style_key(style: TPStyle) -> object:
    try:
        hash(style)
    except TypeError:
        return id(style)
    return style


def _held(spec: ShardSpec, shape: tuple[int, ...], rank: int, tp: int) -> Held:
    """The serial indices rank ``rank``'s shard of a tensor of ``shape`` holds along each dim."""
    if type(spec) in (ShardSpec, HeadShardSpec):  # a selection along spec.dim: no grid needed
        along = dataclasses.replace(spec, dim=0, transposed=False).shard(
            torch.arange(shape[spec.dim]), rank, tp
        )
        return tuple(along if d == spec.dim else torch.arange(n) for d, n in enumerate(shape))
    if len(shape) == 1:
        got = spec.shard(torch.arange(shape[0], dtype=torch.int32), rank, tp)
        if got.dim() != 1:
            raise _NotProbed(f"{spec} gives a {got.dim()}-dim shard of a 1-dim tensor")
        return (got.long(),)
    if len(shape) != 2:
        raise _NotProbed(f"a {len(shape)}-dim parameter")
    rows = torch.arange(shape[0], dtype=torch.int32).view(-1, 1).expand(shape)
    cols = torch.arange(shape[1], dtype=torch.int32).view(1, -1).expand(shape)
    a, b = spec.shard(rows, rank, tp), spec.shard(cols, rank, tp)
    if a.dim() == 2 and bool((a == a[:, :1]).all()) and bool((b == b[:1, :]).all()):
        return a[:, 0].long(), b[0, :].long()
    if a.dim() == 2 and bool((a == a[:1, :]).all()) and bool((b == b[:, :1]).all()):  # stored transposed
        return a[0, :].long(), b[:, 0].long()
    raise _NotProbed(f"rank {rank}'s shard along {spec} is not a block of the parameter")


def _shares(spec: ShardSpec | None, shape: tuple[int, ...], tp: int) -> list[Held]:
    """What each rank holds of a parameter, less what earlier ranks hold as copies (replicated
    KV heads, the K/V rows a fused q|k|v copies beside its split q rows, 2.5D depth layers), so
    each element counts once; the whole for None."""
    if spec is None:
        return [tuple(torch.arange(n) for n in shape)]
    out: list[Held] = []
    for rank in range(tp):
        try:
            held = _unseen(_held(spec, shape, rank, tp), out)
        except ValueError as e:  # a spec that cannot shard yet (2.5D before its depth is known)
            raise _NotProbed(str(e)) from None
        if held is not None:
            out.append(held)
    return out


def _same(a: Tensor, b: Tensor) -> bool:
    return a.numel() == b.numel() and torch.equal(a.sort().values, b.sort().values)


def _unseen(held: Held, before: list[Held]) -> Held | None:
    """``held`` less the lines that an earlier share holds the same way: a 1-dim share less the
    indices held before; a block less its rows held before with the same columns, or its
    columns held before with the same rows. None when nothing is left."""
    if len(held) == 1:
        (index,) = held
        for (prev,) in before:
            index = index[~torch.isin(index, prev)]
        return (index,) if index.numel() else None
    rows, cols = held
    for prev_rows, prev_cols in before:
        if _same(cols, prev_cols):
            rows = rows[~torch.isin(rows, prev_rows)]
        elif _same(rows, prev_rows):
            cols = cols[~torch.isin(cols, prev_cols)]
        if not rows.numel() or not cols.numel():
            return None
    return rows, cols


def _take(t: Tensor, dim: int, index: Tensor) -> Tensor:
    """``t.index_select(dim, index)``, a view when ``index`` is a range."""
    n = int(index.numel())
    start = int(index[0]) if n else 0
    if n and bool((index == torch.arange(start, start + n)).all()):
        return t.narrow(dim, start, n)
    return t.index_select(dim, index.to(t.device))


def _place(total: Tensor, index: Tensor, part: Tensor) -> None:
    part = part.to(total.dtype).expand(*total.shape[:-1], part.shape[-1])  # a bias broadcasts
    total.index_add_(-1, index.to(total.device), part)


@dataclass
class _Shares:
    """The shares reassembled (float64) and the largest magnitude among them."""

    total: Tensor
    peak: float = 0.0

    def add(self, index: Tensor, part: Tensor) -> None:
        _place(self.total, index, part)
        if part.numel():
            self.peak = max(self.peak, float(part.abs().max()))

    def add_bias(self, bias: Tensor | None, spec: ShardSpec | None, tp: int) -> None:
        if bias is not None:
            for (index,) in _shares(spec, tuple(bias.shape), tp):
                self.add(index, _take(bias, 0, index))


def _dense(module: nn.Module, specs: dict[str, ShardSpec | None], tp: int, x: Tensor) -> _Shares:
    """Each rank's ``x[..., its in features] @ its block^T`` into its out features, + the bias."""
    params = dict(module.named_parameters(recurse=False))
    weight = params["weight"].detach()
    conv = not isinstance(module, nn.Linear)  # HF Conv1D: weight (in, out)
    out_f = int(dense_weights(module)[0].shape[0])
    got = _Shares(torch.zeros(*x.shape[:-1], out_f, dtype=torch.float64, device=x.device))
    for held in _shares(specs.get("weight"), tuple(weight.shape), tp):
        block = _take(_take(weight, 0, held[0]), 1, held[1])
        out_idx, in_idx = (held[1], held[0]) if conv else held
        got.add(out_idx, F.linear(_take(x, -1, in_idx), block.t() if conv else block))
    bias = params.get("bias")
    got.add_bias(None if bias is None else bias.detach(), specs.get("bias"), tp)
    return got


def _lookup(module: nn.Embedding, specs: dict[str, ShardSpec | None], tp: int, ids: Tensor) -> _Shares:
    """Each rank's lookup of its vocabulary rows (zeros elsewhere), scaled as the parallel
    embeddings scale it, into its hidden features."""
    weight = module.weight.detach()
    scale = VocabParallelEmbedding.scale_of(module)
    got = _Shares(torch.zeros(*ids.shape, module.embedding_dim, dtype=torch.float64, device=ids.device))
    for rows, cols in _shares(specs.get("weight"), tuple(weight.shape), tp):
        start = int(rows[0]) if rows.numel() else 0
        if not bool((rows == torch.arange(start, start + rows.numel())).all()):
            raise _NotProbed("a shard whose vocabulary rows are not a range")
        got.add(cols, vocab_share(ids, _take(_take(weight, 0, rows), 1, cols), start, scale=scale))
    return got


def _norm(module: nn.LayerNorm, specs: dict[str, ShardSpec | None], tp: int, x: Tensor) -> _Shares:
    """The normalized input times each rank's weight chunk into its features, + the bias."""
    normalized = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    got = _Shares(torch.zeros_like(normalized, dtype=torch.float64))
    if module.weight is None:
        got.add(torch.arange(x.shape[-1]), normalized)
    else:
        weight = module.weight.detach()
        for (index,) in _shares(specs.get("weight"), tuple(weight.shape), tp):
            got.add(index, _take(normalized, -1, index) * _take(weight, 0, index))
    got.add_bias(None if module.bias is None else module.bias.detach(), specs.get("bias"), tp)
    return got


def _probe(module: nn.Module, a: Assignment, specs: dict[str, ShardSpec | None], tp: int) -> float:
    """The largest relative difference of ``module``'s output from its shares'; ValueError past
    the bound."""
    params = [p for _, p in module.named_parameters(recurse=False)]
    if any(p.is_meta for p in params):
        raise _NotProbed("parameters on the meta device")
    like = params[0]
    gen = torch.Generator().manual_seed(0)
    if isinstance(module, nn.Embedding):
        tokens = max(_TOKENS, tp)
        vocab = module.num_embeddings
        spread = torch.arange(tokens) * vocab // tokens  # every rank's rows hit
        ids = torch.stack([torch.randint(0, vocab, (tokens,), generator=gen), spread]).to(like.device)
        x, what = ids, "lookup"
    elif is_dense(module) and set(specs) <= {"weight", "bias"}:
        width = int(dense_weights(module)[0].shape[1])
        x, what = torch.randn(_ROWS, 4, width, generator=gen, dtype=torch.float64), "linear map"
    elif isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
        x, what = (
            torch.randn(_ROWS, 4, *module.normalized_shape, generator=gen, dtype=torch.float64),
            "layer norm",
        )
    else:
        raise _NotProbed(f"the probe does not know how {module_kind(module)} is split")
    if x.is_floating_point():
        x = x.to(like.device, like.dtype)
    with evaluating(module):
        try:
            want = first_tensor(module(x))
        except Exception as exc:  # its forward needs more than one tensor
            raise _NotProbed(f"{type(exc).__name__}: {exc}") from None
        if want is None:
            raise _NotProbed("its output is not a tensor")
        if isinstance(module, nn.Embedding):
            got = _lookup(module, specs, tp, x)
        elif isinstance(module, nn.LayerNorm):
            got = _norm(module, specs, tp, x)
        else:
            got = _dense(module, specs, tp, x)
    where = f"{a.name} ({a.style.name}): {module_kind(module)} split over tp={tp}"
    if tuple(want.shape) != tuple(got.total.shape):
        raise ValueError(
            f"{where}: returns {tuple(want.shape)}, its shares reassemble {tuple(got.total.shape)}; "
            f"the parallel layer computes the plain {what} of the shards"
        )
    return _compare(want, got, where, what)


def _compare(want: Tensor, got: _Shares, where: str, what: str) -> float:
    w, g = want.detach().double(), got.total
    diff = (g - w).abs()
    largest = float(diff.max()) if diff.numel() else 0.0
    scale = max(float(w.abs().max()), float(g.abs().max()), got.peak, 1e-30) if w.numel() else 1.0
    half = want.dtype not in (torch.float32, torch.float64)
    rtol = max(_RTOL, 8 * torch.finfo(want.dtype).eps) if half and want.is_floating_point() else _RTOL
    rel = largest / scale
    if rel <= rtol:  # False for NaN
        return rel
    raise ValueError(
        f"{where} does not compute what the module computes: {_differs(w, g, diff, rtol, scale)}; the "
        f"parallel layer computes the plain {what} of the shards, so whatever else the module's forward "
        "does is lost: keep the module whole (no style), or give it a style that reproduces its forward"
    )


def _differs(want: Tensor, got: Tensor, diff: Tensor, rtol: float, scale: float) -> str:
    """What differs: a constant ratio (a scale), a constant offset, else the largest difference."""
    tol = max(1e-3, rtol)
    big = got.abs() >= 0.1 * float(got.abs().max())
    if bool(big.any()) and bool(torch.isfinite(want).all()):
        ratio = want[big] / got[big]
        r = float(ratio.median())
        if abs(r - 1) > tol and float((ratio - r).abs().max()) <= tol * abs(r):
            return f"its output is scaled by {r:.4g} (an attribute such as embed_scale?)"
        shift = want - got
        s = float(shift.median())
        if abs(s) > tol * scale and float((shift - s).abs().max()) <= tol * scale:
            return f"its output is shifted by {s:.4g} (a constant or a bias its forward adds?)"
    at = tuple(int(i) for i in torch.unravel_index(diff.nan_to_num(float("inf")).argmax(), diff.shape))
    return (
        f"largest difference {float(diff.max()):.3g} at output {at} ({float(want[at]):.4g} whole, "
        f"{float(got[at]):.4g} from the shares; outputs up to {scale:.3g})"
    )
