"""Attention heads over tp ranks: how many query and KV heads a module has, how they split.

Grouped-query attention (GQA; multi-query, MQA, is one KV head) gives ``heads`` query heads
``kv_heads`` key/value heads, query head ``i`` reading KV head ``i // (heads / kv_heads)``.
Query heads split evenly over tp (rank ``r`` holds heads ``[r H/tp, (r+1) H/tp)``). KV heads:

- ``kv_heads % tp == 0``: split too; rank ``r`` holds KV heads ``[r K/tp, (r+1) K/tp)``, exactly
  the ones its query heads read.
- ``tp % kv_heads == 0`` (fewer KV heads than ranks): replicated as Megatron does; rank ``r``
  holds the one KV head ``r K / tp`` its query heads read, ``tp / K`` consecutive ranks hold the
  same head and the gradients of their copies are summed (``ColumnParallelLinear(blocks=K)``).
- otherwise refused: a ValueError naming heads, KV heads and tp.

A fused q|k|v projection (HF Phi3's ``qkv_proj``) holds parts of ``(heads, kv_heads, kv_heads)``
heads of one width; each part splits (or, for KV heads fewer than tp, is copied) as above and
rank ``r`` holds ``[q_r | k_r | v_r]``, the layout the module's own code splits its output by
(``fused_head_indices``).

``head_layout(module)`` reads the counts from the module (or its ``config``), ``HeadShardSpec``
maps a serial K/V projection to each rank's shard and back, ``FusedHeadShardSpec`` a fused one.
All pure (no process group is touched) but ``localize_config``, which after the split gives a
module that reads its head counts from its config its own copy holding one rank's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tessera.tensor_parallel.partition import ShardSpec, check_divisible, shard_range

__all__ = [
    "GROUP_ATTRIBUTES",
    "HEAD_ATTRIBUTES",
    "KV_HEAD_ATTRIBUTES",
    "FusedHeadShardSpec",
    "HeadLayout",
    "HeadShardSpec",
    "block_shard_range",
    "copied_rows",
    "fused_head_indices",
    "head_layout",
    "localize_config",
]

HEAD_ATTRIBUTES = ("num_heads", "n_heads", "num_attention_heads", "n_head", "heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads")
GROUP_ATTRIBUTES = ("num_key_value_groups", "num_kv_groups", "n_rep")  # query heads per KV head


def block_shard_range(size: int, blocks: int, n: int, rank: int, *, where: str = "shard") -> tuple[int, int]:
    """The half-open range of a dimension of ``blocks`` indivisible equal blocks (KV heads)
    that rank ``rank`` of ``n`` holds: ``blocks / n`` whole blocks when ``n`` divides ``blocks``,
    else (``blocks`` divides ``n``) block ``rank * blocks // n``, shared with ``n / blocks - 1``
    other ranks."""
    check_divisible(size, blocks, what="size", where=where, by="blocks (whole heads)")
    if blocks % n and n % blocks:
        raise ValueError(f"{where}: {blocks} blocks (KV heads) neither divide by nor divide tp={n}")
    if not 0 <= rank < n:
        raise ValueError(f"{where}: rank {rank} is outside [0, {n})")
    if blocks % n == 0:
        return shard_range(size, n, rank, where=where)
    per = size // blocks
    block = rank * blocks // n
    return block * per, (block + 1) * per


def _local_heads(heads: int, n: int, *, where: str) -> int:
    if heads % n and n % heads:
        raise ValueError(f"{where}: {heads} heads neither divide by nor divide tp={n}")
    return max(1, heads // n)


def _head_width(size: int, parts: Sequence[int], *, where: str) -> int:
    if not parts or min(parts) < 1:
        raise ValueError(f"{where}: fused parts must each hold >= 1 head, got {tuple(parts)}")
    if size % sum(parts):
        raise ValueError(
            f"{where}: size={size} is not {sum(parts)} heads of one width "
            f"(fused parts of {tuple(parts)} heads)"
        )
    return size // sum(parts)


def fused_head_indices(
    size: int, parts: Sequence[int], n: int, rank: int, *, where: str = "shard"
) -> list[int]:
    """Indices rank ``rank`` of ``n`` holds of a dimension of fused parts, part ``s`` being
    ``parts[s]`` whole heads, every head of one width (q|k|v under grouped-query attention:
    ``(heads, kv_heads, kv_heads)``): of each part its ``block_shard_range`` (its share of the
    heads, or the one head it reads when the part has fewer heads than ranks), parts kept in
    order, so the rank's slice is itself fused."""
    width = _head_width(size, parts, where=where)
    out: list[int] = []
    offset = 0
    for heads in parts:
        start, end = block_shard_range(heads * width, heads, n, rank, where=where)
        out.extend(range(offset + start, offset + end))
        offset += heads * width
    return out


def copied_rows(size: int, parts: Sequence[int], n: int, rank: int) -> list[tuple[int, int, int, int]]:
    """Of rank ``rank``'s slice (``fused_head_indices``), the rows that copy one head shared
    with other ranks (parts with fewer heads than ``n``), as ``(start, end, head, heads)``:
    local rows ``[start, end)`` hold head ``head`` of a part of ``heads``; adjacent parts of the
    same count (k and v) are one range. Empty when every part splits."""
    width = _head_width(size, parts, where="copied_rows")
    out: list[tuple[int, int, int, int]] = []
    at = 0
    for heads in parts:
        local = _local_heads(heads, n, where="copied_rows") * width
        if heads < n:
            head = rank * heads // n
            if out and out[-1][1] == at and out[-1][2:] == (head, heads):
                out[-1] = (out[-1][0], at + local, head, heads)
            else:
                out.append((at, at + local, head, heads))
        at += local
    return out


@dataclass(frozen=True, slots=True)
class HeadShardSpec(ShardSpec):
    """A ``ShardSpec`` along ``dim`` of ``heads`` whole blocks (a K or V projection's KV heads):
    over tp ranks dividing ``heads`` it is the plain split; over more ranks (a multiple of
    ``heads``), ``tp / heads`` consecutive ranks hold copies of one block (their gradients are
    summed in backward, so the copies stay equal). ``unshard`` keeps the first copy of each."""

    heads: int = 1

    def __post_init__(self) -> None:
        ShardSpec.__post_init__(self)
        if self.heads < 1 or self.sections != 1:
            raise ValueError(f"invalid {self!r}: heads >= 1 and no fused sections")

    def __str__(self) -> str:
        return f"{ShardSpec.__str__(self)} in {self.heads} whole heads (replicated when tp > {self.heads})"

    def replicas(self, tp: int) -> int:
        """How many tp ranks hold each shard (an identical copy): 1 when the heads split, else
        ``tp / heads``."""
        return max(1, tp // self.heads)

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        """Rank ``rank``'s shard of the serial tensor ``full`` over ``tp`` ranks."""
        where = f"shard {tuple(full.shape)} along {self}"
        start, end = block_shard_range(int(full.shape[self.dim]), self.heads, tp, rank, where=where)
        part = full.narrow(self.dim, start, end - start)
        return part.t() if self.transposed else part

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """The serial tensor from every rank's shard, in rank order (one copy of each head)."""
        return ShardSpec.unshard(self, list(shards)[:: self.replicas(len(shards))])


@dataclass(frozen=True, slots=True)
class FusedHeadShardSpec(ShardSpec):
    """A ``ShardSpec`` along ``dim`` of fused ``parts``, part ``s`` of ``parts[s]`` whole heads of
    one width (fused q|k|v: ``(heads, kv_heads, kv_heads)``): rank ``r`` holds its share of each
    part's heads in order (``fused_head_indices``); a part with fewer heads than tp ranks is
    copied as ``HeadShardSpec``'s, and ``unshard`` keeps the first copy of each of its heads."""

    parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ShardSpec.__post_init__(self)
        if self.sections != 1 or not self.parts or min(self.parts) < 1:
            raise ValueError(f"invalid {self!r}: parts of >= 1 head each, and no equal sections")

    def __str__(self) -> str:
        counts = ", ".join(str(h) for h in self.parts)
        copied = "(a part copied when tp exceeds it)"
        return f"{ShardSpec.__str__(self)} in fused parts of {counts} whole heads {copied}"

    def replicas(self, tp: int) -> int:
        """How many tp ranks hold each element: 1 when every part splits, ``tp / heads`` when
        every part is copied; ValueError when the parts differ (query heads split, KV heads
        copied): no one count describes the tensor."""
        counts = sorted({max(1, tp // heads) for heads in self.parts})
        if len(counts) > 1:
            raise ValueError(
                f"{self}: over tp={tp} its parts are held by {counts} ranks each (the query heads split, "
                "the KV heads copied), so no one copy count describes it; use tp <= kv_heads"
            )
        return counts[0]

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        """Rank ``rank``'s shard of the serial tensor ``full`` over ``tp`` ranks."""
        where = f"shard {tuple(full.shape)} along {self}"
        index = fused_head_indices(int(full.shape[self.dim]), self.parts, tp, rank, where=where)
        part = full.index_select(self.dim, torch.tensor(index, device=full.device))
        return part.t() if self.transposed else part

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """The serial tensor from every rank's shard, in rank order (one copy of each head)."""
        tp = len(shards)
        where = f"unshard along {self}"
        local = [_local_heads(heads, tp, where=where) for heads in self.parts]
        parts = [s.t() if self.transposed else s for s in shards]
        width = _head_width(int(parts[0].shape[self.dim]), local, where=where)
        pieces = [torch.split(p, [heads * width for heads in local], self.dim) for p in parts]
        out = [pieces[r][s] for s, heads in enumerate(self.parts) for r in range(0, tp, max(1, tp // heads))]
        return torch.cat(out, self.dim).contiguous()


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """An attention module's query heads, KV heads (equal without GQA) and head width (None
    when the module does not say; only GQA needs it, to tell K/V projections by their width)."""

    heads: int
    kv_heads: int
    head_dim: int | None = None

    @property
    def qkv_parts(self) -> tuple[int, int, int]:
        """The heads of a fused q|k|v projection's parts: (heads, kv_heads, kv_heads)."""
        return self.heads, self.kv_heads, self.kv_heads

    @property
    def grouped(self) -> bool:
        """Whether KV heads are shared by several query heads (GQA / MQA)."""
        return self.kv_heads != self.heads

    def check(self, tp: int, *, where: str) -> None:
        """ValueError naming heads, KV heads and tp unless this layout splits over ``tp`` ranks."""
        numbers = f"heads={self.heads}, kv_heads={self.kv_heads}, tp={tp}"
        check_divisible(self.heads, tp, what="heads", where=where)
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"{where}: kv_heads must divide heads ({numbers})")
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ValueError(
                f"{where}: KV heads can neither be split nor replicated over tp ({numbers}): "
                "tp must divide kv_heads or be a multiple of it"
            )

    def local(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) one rank holds."""
        return self.heads // tp, max(1, self.kv_heads // tp)


def _int_attr(obj: object, names: Sequence[str]) -> int | None:
    for attr in names:
        try:
            value = getattr(obj, attr, None)
        except RuntimeError:  # a config's size that varies per layer (dots3 Note's): not one value
            value = None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _width(module: nn.Module, child: str) -> int | None:
    layer = getattr(module, child, None)
    weight = getattr(layer, "weight", None)
    if not isinstance(layer, nn.Module) or not isinstance(weight, Tensor) or weight.dim() != 2:
        return None
    conv = not isinstance(layer, nn.Linear) and hasattr(layer, "nf")  # HF Conv1D: (in, out)
    return int(weight.shape[1] if conv else weight.shape[0])


def head_layout(module: nn.Module, *, where: str = "attention") -> HeadLayout | None:
    """The heads of an attention module, None when it does not say how many it has.

    Query heads: an int attribute of the module (``num_heads``, ``n_heads``,
    ``num_attention_heads``, ``n_head``), else its ``config.num_attention_heads`` (Hugging Face),
    else the width of ``q_proj`` over ``head_dim``. KV heads: an int attribute
    (``num_key_value_heads``, ``num_kv_heads``, ``n_kv_heads``, ``n_kv_head``, ``kv_heads``), else
    ``config.num_key_value_heads``, else heads over ``num_key_value_groups`` / ``n_rep``, else the
    width of ``k_proj`` over ``head_dim``, else as many as query heads. ``head_dim``: the
    module's, else its config's, else ``hidden_size`` (module or config) over heads. Where
    ``head_dim`` and ``q_proj`` / ``k_proj`` are known their widths must agree (ValueError); a
    module's ``qk_head_dim`` (a latent attention's query head width) stands for ``q_proj``'s.
    """
    config = getattr(module, "config", None)
    head_dim = _int_attr(module, ("head_dim",)) or _int_attr(config, ("head_dim",))
    q_width, k_width = _width(module, "q_proj"), _width(module, "k_proj")
    heads = _int_attr(module, HEAD_ATTRIBUTES) or _int_attr(config, ("num_attention_heads",))
    if heads is None and head_dim and q_width is not None:
        heads = q_width // head_dim
    if not heads:
        return None
    kv = _int_attr(module, KV_HEAD_ATTRIBUTES) or _int_attr(config, ("num_key_value_heads",))
    groups = _int_attr(module, GROUP_ATTRIBUTES)
    if kv is None and groups:
        kv = heads // groups
    if kv is None and head_dim and k_width is not None:
        kv = k_width // head_dim
    if head_dim is None:
        hidden = _int_attr(module, ("hidden_size",)) or _int_attr(config, ("hidden_size",))
        head_dim = hidden // heads if hidden and hidden % heads == 0 else None
    layout = HeadLayout(heads, kv or heads, head_dim)
    # a latent attention's query heads (DeepSeek's qk_head_dim: the rotary and the plain part) are
    # wider than the head_dim its config names (the rotary part alone)
    q_dim = _int_attr(module, ("qk_head_dim",)) or head_dim
    if head_dim:
        for child, width, count, dim in (
            ("q_proj", q_width, heads, q_dim),
            ("k_proj", k_width, layout.kv_heads, head_dim),
        ):
            if width is not None and dim and width != count * dim:
                raise ValueError(
                    f"{where}: {child} has {width} output features, not {count} heads x head_dim "
                    f"{dim} (heads={heads}, kv_heads={layout.kv_heads})"
                )
    return layout


def localize_config(module: nn.Module, heads: int, kv_heads: int) -> list[str]:
    """Give ``module`` its own shallow copy of its ``config`` with one rank's head counts
    (``heads`` for ``HEAD_ATTRIBUTES``, ``kv_heads`` for ``KV_HEAD_ATTRIBUTES`` it holds as ints):
    Hugging Face attention reads ``self.config.num_attention_heads`` in its forward. The shared
    config, which the other modules and the serial model read, is not touched (so a later change
    to it, e.g. of ``_attn_implementation``, does not reach the copy). Returns the names set
    (``config.num_attention_heads``, ...); none where the config holds no head count."""
    config = getattr(module, "config", None)
    if config is None or isinstance(config, Tensor | nn.Module):
        return []
    new = {a: heads for a in HEAD_ATTRIBUTES if _int_attr(config, (a,)) is not None}
    new |= {a: kv_heads for a in KV_HEAD_ATTRIBUTES if _int_attr(config, (a,)) is not None}
    if not new:
        return []
    local = copy.copy(config)
    for attr, value in new.items():
        setattr(local, attr, value)
    setattr(module, "config", local)  # noqa: B010 - a config object, not a Module or Parameter
    return [f"config.{a}" for a in new]
