"""Prove, before training, that a model split over the sequence computes what it computes whole.

Context parallelism routes a model's attention to ring or Ulysses and makes its known
positions modules follow the sequence shards (``positions``); everything else must work per
token. A forward that derives positions or a mask from the sequence length it is handed
(rotary angles from ``torch.arange(x.shape[1])`` inline) sees only its rank's slice and
trains silently wrong. ``probe_sequence_split`` measures it, collectively over the ``cp``
group, around the installation of context parallelism: in eval mode and without gradients it
runs the whole sequence of a small random batch of token ids through the model before the
routing is installed (pass 1), then, after it, this rank's slice of the same ids (pass 2),
and compares this rank's positions of the model's output. Each rank compares only its own
outputs, so the collectives inside the forward (tensor-parallel ones, ring attention's) run
alike on every rank and the model may already be tensor-parallel. Forward hooks record, in
both passes, the first tensor output (and input) of every module whose output has the
sequence on dim 1; on a mismatch the ranks agree (one all-reduce) and all raise ValueError
naming the first module whose output differs while its input does not.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from tessera.comm import Group, all_reduce, group_rank, group_size, has_p2p
from tessera.tensor_parallel.context.layout import Layout, sequence_chunks, split_sequence
from tessera.tensor_parallel.context.positions import find_positions
from tessera.tensor_parallel.probing import evaluating

__all__ = ["SequenceProbe", "probe_sequence_split"]

_LOG = logging.getLogger(__name__)
T = TypeVar("T")

# Of the largest magnitude of the whole output. fp32: ring attention merges K/V blocks by
# log-sum-exp where SDPA sums one softmax (Ulysses attends on another layout): round-off of
# ~1e-7 relative per attention (measured <= 3.1e-7 on the 2-layer Llamaish and GPT2ish, ring
# and Ulysses, both layouts); 1e-4 leaves room for deep models. Rotary angles left on local
# positions move the output of a freshly initialized 2-layer model by 3e-2 to 4e-2 of it.
# Half dtypes: every rounding differs, measured 1.3 (bf16) to 1.5 (fp16) epsilons of the
# dtype on the same models: 16 epsilons, for depth (a bf16 model's probe is coarse: 0.125).
_RTOL = 1e-4
_HALF_EPS = 16
_NONE = -1.0e18  # no culprit on this rank (all-reduced with max over minus the call index)


@dataclass(frozen=True, slots=True)
class SequenceProbe:
    """What the probe feeds the model: ``batch`` rows of random token ids below ``vocab_size``
    (drawn from a generator seeded by ``seed``, so every rank draws the same), ``length``
    tokens or more: rounded up to the layout's chunks times ``multiple`` (Megatron sequence
    parallelism cuts each rank's slice again: tp), at most ``max_len`` (and the size of a
    learned position embedding) when known."""

    vocab_size: int
    batch: int = 2
    length: int = 16
    multiple: int = 1
    max_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "batch", "length", "multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"SequenceProbe.{name} must be >= 1, got {getattr(self, name)}")

    def sequence_length(self, cp: int, layout: Layout | str, limit: int | None = None) -> int:
        """The probe's sequence length at ``cp`` ranks (0: none fits ``max_len`` / ``limit``)."""
        chunks = sequence_chunks(cp, layout) * self.multiple
        length = chunks * math.ceil(self.length / chunks)
        bounds = [b for b in (self.max_len, limit) if b is not None]
        return min([length, *[b // chunks * chunks for b in bounds]])

    def ids(self, length: int, device: torch.device) -> Tensor:
        """The (batch, length) token ids, the same on every rank."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab_size, (self.batch, length), generator=gen).to(device)


def _first_tensor(out: Any) -> Tensor | None:
    """A tensor output, an output object's ``.logits``, or the first tensor of a tuple / dict."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, Tensor)), None)


def _sequence_tensor(values: Iterator[Any], length: int) -> Tensor | None:
    for v in values:
        if isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= 2 and v.shape[1] == length:
            return v
    return None


_Cut = Callable[[Tensor], Tensor]


@dataclass(slots=True)
class _Record:
    """Per module call (by name and occurrence, in the order calls end): the first floating
    output with ``length`` on dim 1, and the first such input, cut by ``cut``."""

    length: int
    cut: _Cut
    calls: dict[tuple[str, int], tuple[Tensor, Tensor | None]] = field(default_factory=dict)
    order: list[tuple[str, int]] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)

    def hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            n = self.seen.get(name, 0)
            self.seen[name], self.kinds[name] = n + 1, type(module).__name__
            first = _sequence_tensor(iter((_first_tensor(out),)), self.length)
            if first is None:
                return
            inp = _sequence_tensor(iter((*args, *kwargs.values())), self.length)
            key = (name, n)
            self.order.append(key)
            self.calls[key] = (self.cut(first).clone(), None if inp is None else self.cut(inp).clone())

        return record


@contextmanager
def _recording(model: nn.Module, record: _Record) -> Iterator[None]:
    handles = [
        module.register_forward_hook(record.hook(name), with_kwargs=True)
        for name, module in model.named_modules()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _relative(a: Tensor, b: Tensor) -> float:
    """max |a - b| over the larger of their largest magnitudes (0 when both are 0)."""
    a, b = a.double(), b.double()
    scale = max(float(a.abs().max()), float(b.abs().max())) if a.numel() else 0.0
    return float((a - b).abs().max()) / scale if scale > 0 else 0.0


def _culprit(whole: _Record, part: _Record, tol: float) -> int | None:
    """The pass-1 index of the first call whose output differs while its input does not
    (else the first whose output differs); None when none does."""
    first = None
    for index, key in enumerate(whole.order):
        if key not in part.calls:
            continue
        (out1, in1), (out2, in2) = whole.calls[key], part.calls[key]
        if out1.shape != out2.shape or _relative(out1, out2) <= tol:
            continue
        first = index if first is None else first
        if in1 is None or in2 is None or in1.shape != in2.shape or _relative(in1, in2) <= tol:
            return index  # its input is the same (or cannot be told): it is where they part
    return first


def _device(model: nn.Module) -> torch.device:
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _learned_bound(model: nn.Module, positions: str | None) -> int | None:
    """The smallest size of a learned position embedding among the positions modules."""
    try:
        found = find_positions(model, positions)
    except ValueError:  # a pattern that matches nothing: the installation says so
        return None
    sizes = [n for _, m in found if isinstance(n := getattr(m, "num_embeddings", None), int)]
    return min(sizes, default=None)


def _tolerance(model: nn.Module, out: Tensor | None) -> float:
    """The bound (see ``_RTOL``) for the coarsest floating dtype of the parameters and output."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if out is not None and out.is_floating_point():
        dtypes.add(out.dtype)
    eps = max((torch.finfo(d).eps for d in dtypes), default=torch.finfo(torch.float32).eps)
    return max(_RTOL, _HALF_EPS * eps)


def _compare(out1: Tensor | None, out2: Tensor | None, length: int, cut: _Cut) -> tuple[float, float] | None:
    """(largest difference relative to ``out1``'s largest magnitude, absolute) between this
    rank's positions of the whole output and its slice's; None when they cannot be compared."""
    if out1 is None or out2 is None or not out1.is_floating_point() or out1.dim() < 2:
        return None
    if out1.shape[1] != length or out1.numel() == 0:
        return None
    expected = cut(out1)
    if expected.shape != out2.shape:
        return None
    diff = float((out2.double() - expected.double()).abs().max())
    scale = float(out1.double().abs().max())
    return (diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0)), diff


def _refusal(
    what: str, name: str, kind: str, *, cp: int, layout: Layout, length: int, stats: list[float]
) -> str:
    rel, diff, tol = stats[0], stats[1], stats[4]
    return (
        f"context parallelism changes what {what} computes: at cp={cp} ({layout.value} layout) its output "
        f"on {length} tokens differs from the whole sequence's by up to {diff:.3g} ({rel:.2g} of its largest "
        f"magnitude; bound {tol:.0e}); the first module whose output differs is {name or '(the model)'!r} "
        f"({kind}): its forward derives positions or a mask from the local sequence length; compute them "
        "in a module whose class name says Rotary (found and made to follow), or name it in "
        "ModelSpec(positions=...)"
    )


def probe_sequence_split(
    model: nn.Module,
    group: Group,
    install: Callable[[], T],
    *,
    probe: SequenceProbe | None,
    layout: Layout | str = Layout.CONTIGUOUS,
    positions: str | None = None,
) -> T:
    """Run ``install()`` (which makes ``model`` context-parallel over ``group``, the
    sequence cut by ``layout``) between the two passes of the probe (module docstring);
    return what it returns. Collective over ``group``: every rank calls it alike.

    ``probe`` None installs without probing; so does a model with parameters on the meta
    device, or one that cannot run the probe's input whole (logged). On a mismatch every
    rank raises ValueError naming the first module whose output differs. ``positions``
    (as for ``context_parallelize``): a learned position embedding among them bounds the
    probe's length. Moves two all-reduces of a few numbers, besides the forwards' own.
    """
    if probe is None:
        return install()
    layout = Layout(layout)
    cp, rank = group_size(group), group_rank(group)
    what = type(model).__name__
    if any(p.is_meta for p in model.parameters()):
        _LOG.info("sequence-split probe skipped: %s has parameters on the meta device (deferred init)", what)
        return install()
    if not has_p2p(group):  # ring attention sends and receives
        _LOG.info("sequence-split probe skipped: the cp group's backend has no send/recv (a test backend)")
        return install()
    length = probe.sequence_length(cp, layout, _learned_bound(model, positions))
    if length == 0:
        _LOG.info("sequence-split probe skipped: no sequence length fits %s at cp=%d", what, cp)
        return install()
    device, start = _device(model), time.perf_counter()
    ids = probe.ids(length, device)

    def cut(t: Tensor) -> Tensor:
        return split_sequence(t, rank, cp, layout, dim=1)

    whole, error, out1 = _Record(length, cut), None, None
    with evaluating(model), _recording(model, whole):
        try:
            out1 = _first_tensor(model(ids))
        except Exception as e:  # whatever it is, the model cannot be probed on this input
            error = e
    failed = all_reduce(torch.tensor([0.0 if error is None else 1.0], device=device), group, op="max")
    if float(failed[0]):
        _LOG.warning("sequence-split probe skipped: %s cannot run %d tokens whole: %s", what, length, error)
        return install()
    result = install()
    part = _Record(length // cp, lambda t: t)
    with evaluating(model), _recording(model, part):
        out2 = _first_tensor(model(cut(ids)))
    compared, tol = _compare(out1, out2, length, cut), _tolerance(model, out1)
    rel, diff = compared if compared is not None else (0.0, 0.0)
    culprit = _culprit(whole, part, tol) if rel > tol else None
    mine = [rel, diff, _NONE if culprit is None else -culprit, 0.0 if compared is not None else 1.0, tol]
    stats = all_reduce(torch.tensor(mine, dtype=torch.float64, device=device), group, op="max").tolist()
    seconds = time.perf_counter() - start
    if stats[3]:
        _LOG.info(
            "sequence-split probe skipped: the output of %s has no sequence of %d on dim 1 (%.2f s)",
            what, length, seconds,
        )  # fmt: skip
        return result
    if stats[0] > stats[4]:
        name = whole.order[int(-stats[2])][0] if stats[2] > _NONE else ""
        kind = whole.kinds.get(name, what)
        raise ValueError(_refusal(what, name, kind, cp=cp, layout=layout, length=length, stats=stats))
    _LOG.info(
        "sequence-split probe: %s at cp=%d (%s), %d x %d tokens, largest difference %.2g of the output's "
        "largest magnitude (bound %.0e), %.2f s",
        what, cp, layout.value, probe.batch, length, stats[0], stats[4], seconds,
    )  # fmt: skip
    return result
