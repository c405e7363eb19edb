"""The names a Hugging Face checkpoint holds a model's tensors under, read as the model's.

``transformers`` renames a checkpoint's tensors as it loads them (its conversion mapping: a
family's older names, ``backbone.`` for ``model.``, Mixtral's ``block_sparse_moe`` for ``mlp``,
a router's ``expert_bias`` for ``e_score_correction_bias``, ...) and merges some: every MoE
family's per-expert ``experts.<e>.gate_proj.weight`` / ``up_proj`` / ``down_proj`` become the
stacked ``experts.gate_up_proj`` and ``experts.down_proj``, and ``save_pretrained`` writes
them back so. `hf_renames` gives ``import_weights`` those renames (`HFNames`, read from the
pinned transformers' own mapping of the model), and `expert_merges` / `per_expert` the
per-expert tensors as older parts (``ExportPart.legacy``) of a converted mixture's banks, so
that a checkpoint from ``save_pretrained`` or the Hub imports as transformers loads it, each ep
rank reading its own experts' tensors. A tensor that transformers transforms otherwise on load
(a fused ``query_key_value`` split into three, ...) is not read; `HFNames.unread` says which,
for the import's error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from tessera.launcher.checkpoint.exported import Band, ExportPart
from tessera.launcher.checkpoint.tensorfile import Renamed

__all__ = ["HFNames", "expert_merges", "hf_renames", "per_expert"]

log = logging.getLogger(__name__)
_PER_EXPERT = re.compile(r"experts\.\*\.(?P<tail>[\w.]+)\.weight$")


@dataclass(frozen=True)
class HFNames:
    """A model's checkpoint renames (transformers' ``WeightRenaming`` rules, in order, then its
    base-model prefix added or dropped as ``from_pretrained`` does); ``converters``: its
    ``WeightConverter`` rules, which merge or split tensors. A stored name that is one of the
    model's own (``shapes``) is read as it is."""

    renamings: tuple[Any, ...]
    converters: tuple[Any, ...]
    prefix: str
    shapes: Mapping[str, tuple[int, ...]]  # the model's tensors, by name

    def __call__(self, stored: str) -> str:
        """The model's name for the checkpoint's tensor ``stored`` (itself when not renamed)."""
        return self.read(stored).name

    def read(self, stored: str) -> Renamed:
        """The checkpoint's tensor ``stored`` as the model knows it: its name, and whether
        transformers transposes it as it loads it (a whole matrix: Ergo's ``gate_kernel``)."""
        if stored in self.shapes:
            return Renamed(stored)
        from transformers.core_model_loading import apply_converters, apply_renamings

        renamed = apply_renamings(stored, list(self.renamings))
        final, _ = apply_converters(renamed, list(self.converters))
        transposed = self._transposing(renamed, final)
        if transposed:  # known by its final name
            renamed = final
        lead = f"{self.prefix}."
        if self.prefix and final.startswith(lead) and final[len(lead) :] in self.shapes:
            return Renamed(renamed[len(lead) :] if renamed.startswith(lead) else renamed, transposed)
        if self.prefix and f"{lead}{final}" in self.shapes:
            return Renamed(f"{lead}{renamed}", transposed)
        return Renamed(renamed, transposed)

    def unread(self, stored: Iterable[str]) -> str:
        from transformers.core_model_loading import apply_renamings

        found: dict[str, list[str]] = {}
        for name in stored:
            if name in self.shapes:
                continue
            renamed = apply_renamings(name, list(self.renamings))
            for converter in self.converters:
                _, pattern = converter.rename_source_key(renamed)
                if pattern is not None:
                    if not _read(converter):
                        how = "+".join(repr(op) for op in converter.operations)
                        into = ", ".join(converter.target_patterns)
                        found.setdefault(f"{how} into {into}", []).append(name)
                    break
        if not found:
            return ""
        listed = "; ".join(f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''} ({how})"
                           for how, names in found.items())  # fmt: skip
        return (
            f"transformers transforms these tensors as it loads them, which import does not: {listed}; "
            "load the model with from_pretrained, write its state dict "
            "(safetensors.torch.save_file(model.state_dict(), path)) and import that"
        )

    def _transposing(self, renamed: str, final: str) -> bool:
        """Whether the converter matching ``renamed`` (after the renamings) transposes that whole
        matrix into the model's ``final`` one (Ergo's ``gate_kernel``)."""
        for converter in self.converters:
            _, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                shape = self.shapes.get(final) or self.shapes.get(f"{self.prefix}.{final}", ())
                return _transposes(converter) and len(shape) == 2
        return False

    def parts(self, name: str) -> tuple[ExportPart, ...]:
        """Where a checkpoint holds the model's tensor ``name`` when transformers splits one
        tensor into it and its siblings on load (``Split(dim=0)``: Ling's and Sarvam's fused
        ``query_key_value`` into ``q_proj``, ``k_proj``, ``v_proj``): its band of that tensor's
        first dimension, sized by the siblings' shapes in order; or, where transformers joins
        several into it (``Concatenate(dim=0)``: Kimi-Linear's ``q_conv1d``, ``k_conv1d``,
        ``v_conv1d`` into ``conv1d``), each of them, ``joined`` in order; () where none."""
        for converter in self.converters:
            joined = _joined_of(converter)
            if joined is not None and joined[1] in name:
                sources, target = joined
                return tuple(
                    ExportPart(name.replace(target, source, 1), index=k, joined=True)
                    for k, source in enumerate(sources)
                )
            split = _split_of(converter)
            if split is None:
                continue
            source, targets = split
            for target in targets:
                if target not in name:
                    continue
                siblings = [name.replace(target, other, 1) for other in targets]
                if not all(s in self.shapes for s in siblings):
                    continue
                sizes = [self.shapes[s][0] if self.shapes[s] else 0 for s in siblings]
                k, dim = targets.index(target), -2 if len(self.shapes[name]) >= 2 else -1
                start = sum(sizes[:k])
                return (ExportPart(name.replace(target, source, 1), band=Band(dim, start, start + sizes[k])),)
        return ()


def _read(converter: Any) -> bool:
    """Whether import reads what ``converter`` makes (`per_expert`, `HFNames.parts`, a transpose)."""
    made = (_merge_of(converter), _split_of(converter), _joined_of(converter))
    return any(m is not None for m in made) or _transposes(converter)


def _transposes(converter: Any) -> bool:
    """A converter that only swaps a matrix's two dimensions (``Transpose(0, 1)``), one to one."""
    ops = converter.operations
    dims = {getattr(ops[0], "dim0", None), getattr(ops[0], "dim1", None)} if len(ops) == 1 else set()
    one = len(converter.source_patterns) == len(converter.target_patterns) == 1
    return one and type(ops[0]).__name__ == "Transpose" and dims == {0, 1} and not ops[0].check_dims


def _split_of(converter: Any) -> tuple[str, tuple[str, ...]] | None:
    """A converter that splits one tensor along its first dimension into one piece per target,
    each sized like the target (``Split(dim=0)``): its source and targets, as plain names."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    plain = re.compile(r"^[\w.]+$")
    if ops != [("Split", 0)] or len(sources) != 1 or not all(plain.match(p) for p in [*sources, *targets]):
        return None
    return sources[0], tuple(targets)


def _joined_of(converter: Any) -> tuple[tuple[str, ...], str] | None:
    """A converter that concatenates several tensors along their first dimension into one
    (``Concatenate(dim=0)``): its sources and target, as plain names."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    plain = re.compile(r"^[\w.]+$")
    if (
        ops != [("Concatenate", 0)]
        or len(targets) != 1
        or not all(plain.match(p) for p in [*sources, *targets])
    ):
        return None
    return tuple(sources), targets[0]


def _conversion_mapping(model: nn.Module) -> list[Any] | None:
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    try:
        return list(get_model_conversion_mapping(model))
    except Exception as e:  # a model transformers cannot map: its checkpoint is read by its names
        log.warning(
            "%s: transformers' conversion mapping not read (%s: %s)",
            type(model).__name__,
            type(e).__name__,
            e,
        )
        return None


def hf_renames(model: nn.Module) -> HFNames | None:
    """How a checkpoint of ``model`` (a ``transformers`` model, before ``boost()`` converts it)
    names its tensors, read as ``model`` names them; None for another model, or a family
    without renames or merges."""
    transforms = _conversion_mapping(model)
    if not transforms:
        return None
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return HFNames(
        renamings=tuple(t for t in transforms if isinstance(t, WeightRenaming)),
        converters=tuple(t for t in transforms if isinstance(t, WeightConverter)),
        prefix=str(getattr(model, "base_model_prefix", "") or ""),
        shapes={name: tuple(t.shape) for name, t in model.state_dict().items()},
    )


def _merge_of(converter: Any) -> tuple[str, tuple[str, ...]] | None:
    """A converter that stacks per-expert ``nn.Linear`` weights (``MergeModulelist(dim=0)``, and
    for two of them ``Concatenate(dim=1)``: gate rows, then up) into one bank: the bank's name
    after ``experts.`` and each per-expert tensor's between ``experts.<e>.`` and ``.weight``."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    sources = [_PER_EXPERT.search(p) for p in converter.source_patterns]
    targets = list(converter.target_patterns)
    want = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(sources) > 1 else [])
    if ops != want or len(targets) != 1 or "experts." not in targets[0] or not all(sources):
        return None
    fused = targets[0].rpartition("experts.")[2]
    return fused, tuple(m.group("tail") for m in sources if m is not None)


def expert_merges(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The expert banks ``model``'s checkpoints hold per expert (transformers merges them on load,
    ``save_pretrained`` splits them): each bank's name after ``experts.`` (``gate_up_proj``) ->
    the per-expert tensors it stacks, in order (``("gate_proj", "up_proj")``)."""
    names = hf_renames(model)
    merges = (_merge_of(c) for c in (names.converters if names is not None else ()))
    return dict(m for m in merges if m is not None)


def per_expert(
    exported: Mapping[str, tuple[ExportPart, ...]], merges: Mapping[str, tuple[str, ...]], experts: int
) -> dict[str, tuple[ExportPart, ...]]:
    """``exported`` with each whole part of a bank in ``merges`` (``<block>.experts.gate_up_proj``,
    or a band of it holding one of the per-expert tensors stacked in it) given, as its
    ``legacy`` parts, those ``experts`` per-expert tensors (``<block>.experts.<e>.<tail>.weight``,
    each expert ``e`` of the bank)."""
    out = {}
    for name, parts in exported.items():
        out[name] = tuple(_with_legacy(p, merges, experts) for p in parts)
    return out


def _with_legacy(part: ExportPart, merges: Mapping[str, tuple[str, ...]], experts: int) -> ExportPart:
    block, _, fused = part.name.rpartition(".experts.")
    tails = merges.get(fused)
    if not block or tails is None or part.index is not None or part.legacy:
        return part
    band, tail = part.band, tails[0]
    if len(tails) > 1:  # gate and up stacked: the band must be one of them, whole
        if band is None or band.dim != -2 or band.step != 1 or band.start % band.size:
            return part
        k = band.start // band.size
        if k >= len(tails):
            return part
        band, tail = None, tails[k]
    legacy = tuple(
        ExportPart(f"{block}.experts.{e}.{tail}.weight", index=e, transpose=part.transpose, band=band)
        for e in range(experts)
    )
    return replace(part, legacy=legacy)
