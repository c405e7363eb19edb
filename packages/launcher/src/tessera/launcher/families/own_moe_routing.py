"""How a user's mixture routes, measured: which `tessera.moe.RouterSpec` (scores, a choice
bias, a group limit, a scale) and renormalisation give the block's own output.

The names and the code of a user's router say nothing reliable, so every reading that
``RouterSpec`` can express is tried against the block's output on a probe (`candidates`):
softmax or sigmoid scores; no choice bias, or one of the block's choice-bias candidates; no
group limit, or any limit of ``G`` groups keeping ``M`` (by the best expert's score or by the
sum of the best two: `group_limits`); the top-k weights renormalised or not. The **scale**
is not tried but fitted (the routed output is linear in it: least squares against the
block's output less its shared expert, good to about 1e-7), then taken from a float attribute
of the block or of its router that equals it to 1e-6, else kept to seven significant digits.

A **choice-bias candidate** is an ``[E]`` floating tensor of the block or of its router
that does not train: a buffer, or a parameter with ``requires_grad=False``
(`choice_biases`), as DeepSeek-V3's ``e_score_correction_bias``. Such a bias only chooses:
no gradient reaches it through a top-k, and ``tessera.moe`` holds it as a buffer that no
optimizer sees. A trainable ``[E]`` parameter there is therefore refused, named, rather than
quietly frozen (`own_moe_readings.layout`). The probe fills every candidate with random
values of the scores' spread (each score function gets its own probe, so each sees a bias
that changes choices without swamping the scores), so a reading that adds a candidate the
block does not read matches nothing; the block's values are put back after each run, and a
candidate the block's forward changes is noted (`Prober.moved`: a bias balanced inside the
forward, which the caller refuses since the converted router would not move it).

Two readings may both give the probe's output and still route differently elsewhere (a
group limit that few tokens exercise). `disagreements` finds rows on which the matching
readings differ (from the router's weight alone); `read_routing` runs the block on them, drops
the readings that do not give its output there, and refuses what still disagrees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from tessera.moe import RouterSpec
from tessera.moe.router import GroupScore, ScoreFunction, route

__all__ = [
    "RTOL",
    "SCORES",
    "Probe",
    "Prober",
    "RoutingReading",
    "candidates",
    "choice_biases",
    "disagreements",
    "group_limits",
    "read_routing",
    "reproduces",
]

RTOL = 1e-4  # fp32 round-off of the block's output, relative to its largest entry
_SNAP = 1e-6  # a fitted scale is a float attribute of the block this close to it (fits: ~1e-7)
SCORES: tuple[ScoreFunction, ...] = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class RoutingReading:
    """A router as ``tessera.moe`` computes it: ``spec`` (its choice bias, when it has one,
    is the block's tensor ``bias``, named relative to the block) and ``renormalize``."""

    spec: RouterSpec
    renormalize: bool
    bias: str | None = None

    def describe(self) -> str:
        """A short account, for logs and refusals."""
        s = self.spec
        parts = [s.score] + ([f"choice bias {self.bias}"] if self.bias else [])
        if s.groups > 1:
            parts.append(f"{s.top_groups} of {s.groups} groups by {s.group_score}")
        parts.append("renormalised" if self.renormalize else "not renormalised")
        return ", ".join(parts + ([f"scale {s.scale:.7g}"] if s.scale != 1.0 else []))


@dataclass(frozen=True, slots=True)
class Probe:
    """One run of the block: its input rows ``tokens [T, d]``, the router's ``logits [T, E]``
    (fp32), the block's output ``want [T, d]`` (fp32), the values its choice-bias candidates
    held meanwhile (``bias``, by name) and the scalar tensors it recorded on itself
    (``recorded``, by attribute: a load-balancing loss)."""

    tokens: Tensor
    logits: Tensor
    want: Tensor
    bias: Mapping[str, Tensor]
    recorded: Mapping[str, Tensor]


def choice_biases(block: nn.Module, router: str, experts: int) -> tuple[dict[str, Tensor], list[str]]:
    """The choice-bias candidates (module docstring) of ``block`` by name relative to it, held
    by the block itself or anywhere inside its router child ``router``; and the names of the
    ``[experts]`` parameters there that train (for the caller to refuse)."""
    found: dict[str, Tensor] = {}
    trained: list[str] = []
    for prefix, owner, recurse in (("", block, False), (f"{router}.", block.get_submodule(router), True)):
        tensors = [(n, b, False) for n, b in owner.named_buffers(recurse=recurse)]
        tensors += [(n, p, p.requires_grad) for n, p in owner.named_parameters(recurse=recurse)]
        for name, tensor, trains in tensors:
            if tensor.is_floating_point() and tuple(tensor.shape) == (experts,):
                if trains:
                    trained.append(prefix + name)
                else:
                    found[prefix + name] = tensor
    return found, trained


def group_limits(experts: int, top_k: int) -> list[tuple[int, int, GroupScore]]:
    """Every group limit that may change a choice of ``top_k`` of ``experts``: ``G`` groups
    (``2 <= G < experts``, dividing it) of which ``M`` are kept (``1 <= M < G``, holding at least
    ``top_k`` experts), by the best expert (``max``, only for ``M < top_k``: the ``top_k`` best
    experts lie in the ``top_k`` groups of best experts, so keeping as many changes nothing)
    or by the best two (``top2``, two or more experts a group). Fewest groups first."""
    out: list[tuple[int, int, GroupScore]] = []
    for groups in range(2, experts):
        per = experts // groups
        if experts % groups:
            continue
        for kept in range(groups - 1, 0, -1):
            if kept * per < top_k:
                continue
            if kept < top_k:
                out.append((groups, kept, "max"))
            if per >= 2:
                out.append((groups, kept, "top2"))
    return out


def candidates(experts: int, top_k: int, biases: Sequence[str]) -> Iterator[RoutingReading]:
    """Every reading to try, simplest first (no bias before a bias, no group limit before one,
    renormalised before not), each at scale 1 (`reproduces` fits the scale)."""
    limits: list[tuple[int, int, GroupScore]] = [(1, 1, "max"), *group_limits(experts, top_k)]
    for score in SCORES:
        for bias in (None, *biases):
            for groups, kept, by in limits:
                spec = RouterSpec(score, bias is not None, groups, kept, by)
                for renormalize in (True, False):
                    yield RoutingReading(spec, renormalize, bias)


def _route(
    reading: RoutingReading, top_k: int, logits: Tensor, bias: Mapping[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """The reading's ``choices, weights [T, k]`` for ``logits``, its bias from ``bias``."""
    value = None if reading.bias is None else bias[reading.bias].detach().float().to(logits.device)
    r = route(logits, top_k, renormalize=reading.renormalize, spec=reading.spec, bias=value)
    return r.choices, r.weights


def _combined(choices: Tensor, weights: Tensor, outputs: Tensor) -> Tensor:
    """``sum_j weights[t, j] * outputs[choices[t, j], t]`` for every row ``t``
    (``outputs [E, T, d]``: every expert's output on every row)."""
    rows = torch.arange(choices.shape[0], device=choices.device)[:, None]
    return (weights[..., None] * outputs[choices, rows]).sum(dim=1)


def reproduces(
    reading: RoutingReading,
    top_k: int,
    probe: Probe,
    outputs: Tensor,
    shared: Tensor | None,
    scales: Sequence[float] = (),
    *,
    fit: bool = True,
) -> RoutingReading | None:
    """``reading`` with its scale (fitted when ``fit``, module docstring; ``scales``: the block's
    float attributes) if it gives ``probe.want`` from every expert's output on the probe's rows
    (``outputs [E, T, d]``) and the shared expert's (``shared [T, d]``), to `RTOL`; else None."""
    choices, weights = _route(
        replace(reading, spec=replace(reading.spec, scale=1.0)), top_k, probe.logits, probe.bias
    )
    routed = _combined(choices, weights, outputs)
    rest = probe.want if shared is None else probe.want - shared
    scale = reading.spec.scale
    if fit:
        norm = float(routed.double().pow(2).sum())
        scale = float((rest.double() * routed.double()).sum()) / norm if norm > 0 else 1.0
        if not (math.isfinite(scale) and scale > 0):
            return None
        near = [s for s in (1.0, *scales) if abs(s - scale) <= _SNAP * scale]
        scale = near[0] if near else float(f"{scale:.7g}")
    bound = RTOL * (float(probe.want.abs().max()) or 1.0)
    if float((scale * routed - rest).abs().max()) > bound:
        return None
    return replace(reading, spec=replace(reading.spec, scale=scale))


def disagreements(
    readings: Sequence[RoutingReading],
    top_k: int,
    weight: Tensor,
    bias: Mapping[ScoreFunction, Mapping[str, Tensor]],
    rows: int = 4096,
) -> Tensor:
    """Random input rows ``[n, d]`` (at most 64) on which ``readings`` do not all route alike
    (other experts, or their weights off by more than `RTOL`), from the router's ``weight
    [E, d]`` and the bias values each score function's probe used; empty when none do."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.device)
    logits = (x @ weight.detach().float().t()).float()
    routes = []
    for r in readings:
        choices, weights = _route(r, top_k, logits, bias[r.spec.score])
        order = choices.argsort(dim=-1)
        routes.append((choices.gather(1, order), weights.gather(1, order)))
    (c0, w0), differ = routes[0], torch.zeros(rows, dtype=torch.bool, device=logits.device)
    for c, w in routes[1:]:
        differ |= (c != c0).any(dim=-1) | ((w - w0).abs() > RTOL * w0.abs().clamp_min(1e-6)).any(dim=-1)
    return x[differ.nonzero().flatten()[:64]].to(weight.dtype)


def _scalars(module: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in vars(module).items() if isinstance(v, Tensor) and v.dim() == 0}


@dataclass
class Prober:
    """Runs ``block`` (named ``name``; its router's weight ``weight [E, d]``) on rows with its
    choice-bias candidates ``biases`` filled with each score function's random values
    (``values``: of the spread of that function's scores), puts their values back, and keeps
    the candidates its forward changed (``moved``: a bias balanced inside the forward)."""

    name: str
    block: nn.Module
    weight: Tensor
    biases: tuple[str, ...]
    values: dict[ScoreFunction, dict[str, Tensor]] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(2)
        experts, d = self.weight.shape
        logits = (torch.randn(64, d, generator=gen).to(self.weight) @ self.weight.detach().t()).float()
        held = self._tensors()
        for score in SCORES:  # each as the block holds it (its dtype and device)
            spread = float((logits.softmax(-1) if score == "softmax" else logits.sigmoid()).std())
            self.values[score] = {
                n: (torch.randn(experts, generator=gen) * spread).to(held[n]) for n in self.biases
            }

    def _tensors(self) -> dict[str, Tensor]:
        return dict(self.block.named_buffers()) | dict(self.block.named_parameters())

    def run(self, x: Tensor) -> dict[ScoreFunction, Probe]:
        """The block's output on ``x [..., d]`` under each score function's bias values."""
        held = {n: t.detach().clone() for n, t in self._tensors().items() if n in self.biases}
        tokens = x.reshape(-1, x.shape[-1])
        logits = (tokens @ self.weight.detach().t()).float()
        probes: dict[ScoreFunction, Probe] = {}
        try:
            for score in SCORES:
                if not held and probes:  # no candidate: one run serves both
                    probes[score] = probes[SCORES[0]]
                    continue
                with torch.no_grad():
                    tensors = self._tensors()
                    for n, v in self.values[score].items():
                        tensors[n].copy_(v)
                    before = _scalars(self.block)
                    want = self.block(x)
                if not isinstance(want, Tensor) or want.shape != x.shape:
                    raise ValueError(
                        f"{self.name} ({type(self.block).__name__}) returns {type(want).__name__}, not one "
                        "tensor shaped like its input: a converted tessera.moe.MoE could not stand in for it"
                    )
                recorded = {k: v for k, v in _scalars(self.block).items() if before.get(k) is not v}
                after = self._tensors()  # a forward may have replaced a tensor, not only changed it
                self.moved |= {n for n, v in self.values[score].items() if not torch.equal(after[n], v)}
                bias = {n: v.float().to(logits.device) for n, v in self.values[score].items()}
                want = want.reshape(tokens.shape).float()
                probes[score] = Probe(tokens.float(), logits, want, bias, recorded)
        finally:
            with torch.no_grad():
                tensors = self._tensors()
                for n, v in held.items():
                    tensors[n].copy_(v)
        return probes


Outputs = Callable[[Tensor], tuple[Tensor, Tensor | None]]
"""Rows ``[T, d]`` -> every expert's output on every row ``[E, T, d]`` and the shared
expert's ``[T, d]`` (None: none), fp32."""


def read_routing(
    prober: Prober,
    top_k: int,
    outputs: Outputs,
    probes: Mapping[ScoreFunction, Probe],
    scales: Sequence[float] = (),
) -> list[RoutingReading]:
    """Every routing (`candidates`) that gives the block's output in ``probes`` (`Prober.run`)
    with its experts computing ``outputs``, settled on rows where they disagree (module
    docstring); the first is the reading to take. ValueError when the block's outputs cannot
    tell them apart."""
    routed, shared = outputs(probes[SCORES[0]].tokens)
    matches = []
    for c in candidates(prober.weight.shape[0], top_k, prober.biases):
        hit = reproduces(c, top_k, probes[c.spec.score], routed, shared, scales)
        if hit is not None:
            matches.append(hit)
    if len(matches) < 2:
        return matches
    rows = disagreements(matches, top_k, prober.weight, prober.values)
    if not rows.numel():
        return matches
    again = prober.run(rows[None])
    routed, shared = outputs(again[SCORES[0]].tokens)
    matches = [m for m in matches if reproduces(m, top_k, again[m.spec.score], routed, shared, fit=False)]
    if len(matches) > 1 and disagreements(matches, top_k, prober.weight, prober.values).numel():
        raise ValueError(
            f"{prober.name} ({type(prober.block).__name__}): its output on random tokens does not tell apart "
            f"the routings {'; '.join(m.describe() for m in matches)}, which differ elsewhere"
        )
    return matches
