"""``boost(..., verify=True)``: the first training step is compared with a serial step of the
same model before anything is updated.

``boost`` keeps a deep copy of the user's model (before tensor parallelism touches it) in a
`Verifier`. On the first ``Engine.train_step`` the verifier

1. gathers the parallel model's current weights by serial name over tp, ep, ZeRO and
   pipeline ranks; unless the engine loaded a checkpoint or imported weights since ``boost``,
   they must equal the copy's (the model as given, to the tolerance below): a parameter
   split, placed or shuffled wrongly (an expert bank's slice on the wrong rank) is refused
   here, naming it, since a model trained consistently from a wrong start passes step 2;
   then loads them into the copy (so a resumed or imported run is verified too) and runs the
   serial fp32 forward and backward of the whole global batch on it, in as many equal row
   chunks as the engine trains (dp x microbatches): the cross-entropy's mean over every
   counted token of the batch (targets of -100 count for nothing), or, for a
   ``ModelSpec.loss``, each chunk's loss averaged, as the engine trains them. The copy is
   the model's deep copy in every respect the engine sets: the router losses that
   ``tessera.moe.MoE`` layers train on from inside their backward weigh ``1 / chunks`` per
   call, as the engine's scale and the dp average weigh them, and a loss function that reads
   the model (an auxiliary loss summed over its layers, through a closure, a bound method,
   a partial or a module-level name) reads the copy instead (`tessera.launcher.train.bound`);
2. lets the parallel step run as usual, and, from an optimizer step pre-hook (after every
   reduction: dp average, tp / sequence-parallel sums, tied-weight sums, loss scaling
   undone), gathers the parallel gradients by serial name (`local_full_gradients`), undoes
   gradient clipping, and compares the loss and each gradient with the serial ones;
3. on a match, lets the optimizer step and drops the copy, logging the cost in seconds; on a
   mismatch raises ``ValueError`` on every rank, naming the parameters that differ (worst
   absolute and relative difference), before any weight changes.

A step skipped for a non-finite gradient norm (an fp16 overflow) is verified at the next one.

Tolerance (`tolerance`): a gradient matches when its largest absolute difference is at most
``rtol`` times the largest absolute value of the serial gradient (or, for a gradient tiny
next to the rest, of ``1e-3`` times the largest over the whole model); the loss to ``rtol``
relative. ``rtol`` is 1e-4 in fp32 (round-off of other summation orders over tp, dp and
microbatches, measured ~1e-6) and 8 machine epsilons of the compute dtype in mixed precision
(bf16: 6.3e-2, fp16: 7.8e-3), against the serial fp32 step. A lost reduction over 2 ranks is
off by ~50%, far outside either.

Refused (ValueError at ``boost``): dropout (random streams differ between the serial and the
parallel model: build the model with dropout 0 to verify it) and routers that sample their
experts (``tessera.moe.KeptRouter.sampling``: PhiMoE's router and input jitters), parameters on
the meta device, the chunk memory manager (it steps chunk by chunk). The copy holds the whole model
on every rank, and its gradients, until the first step ends.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Group, all_reduce
from tessera.comm.consensus import RemoteFailure, raise_together
from tessera.launcher.checkpoint.consolidate import local_full_gradients, local_full_parameters
from tessera.launcher.checkpoint.placement import Boosted
from tessera.launcher.config import BoostConfig
from tessera.launcher.config.verify_rules import verify_problems
from tessera.launcher.train.batches import split_inputs
from tessera.launcher.train.bound import bound_to_copy
from tessera.launcher.train.objective import IGNORE_INDEX
from tessera.moe import set_aux_grad_scale
from tessera.moe.kept_router import KeptRouter
from tessera.pipeline import split_microbatches
from tessera.zero.clip import clip_coefficient

__all__ = ["Difference", "Verifier", "compare_gradients", "tolerance"]

log = logging.getLogger(__name__)

Loss = Callable[[Tensor, Tensor], Tensor]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FLOOR = 1e-3  # a gradient's scale is at least this fraction of the model's largest gradient


def tolerance(precision: str) -> float:
    """The relative tolerance of a verified step in ``precision`` (see the module docstring)."""
    if precision not in _DTYPES:
        raise ValueError(f"verify: unknown precision {precision!r} (one of {', '.join(_DTYPES)})")
    return max(1e-4, 8 * torch.finfo(_DTYPES[precision]).eps)


@dataclass(frozen=True, slots=True)
class Difference:
    """A parameter whose parallel gradient differs from the serial one: the largest absolute
    difference and that over the gradient's scale."""

    name: str
    abs: float
    rel: float

    def __str__(self) -> str:
        return f"{self.name} (abs {self.abs:.3g}, rel {self.rel:.3g})"


def compare_gradients(
    serial: Mapping[str, Tensor], parallel: Mapping[str, Tensor], rtol: float
) -> tuple[list[Difference], Difference | None]:
    """The parameters of ``parallel`` whose gradients differ from ``serial``'s beyond
    ``rtol`` (worst first), and the worst difference of all (None when nothing is compared)."""
    model_scale = max((float(g.abs().max()) for g in serial.values() if g.numel()), default=0.0)
    floor = max(_FLOOR * model_scale, torch.finfo(torch.float32).tiny)
    out: list[Difference] = []
    for name, got in parallel.items():
        want = serial.get(name)
        if want is None or want.shape != got.shape:
            shape = None if want is None else tuple(want.shape)
            what = f"{name} (shape {tuple(got.shape)}, serial {shape})"
            out.append(Difference(what, float("inf"), float("inf")))
            continue
        if not got.numel():
            continue
        worst = float((got.float() - want.float()).abs().max())
        scale = max(float(want.abs().max()), floor)
        out.append(Difference(name, worst, worst / scale if worst == worst else float("inf")))
    out.sort(key=lambda d: -d.rel)
    return [d for d in out if not d.rel <= rtol], out[0] if out else None


def _unverifiable(model: nn.Module, config: BoostConfig) -> list[str]:
    problems = verify_problems(config, main_job=False)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        problems.append(f"parameters on the meta device ({', '.join(meta[:3])}): materialise them first")
    for name, module in model.named_modules():
        drops = [
            (attr, value)
            for attr, value in vars(module).items()
            if "dropout" in attr.lower() and isinstance(value, float) and value > 0
        ]
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            drops.append(("p", module.p))
        if isinstance(module, KeptRouter) and module.sampling:  # random like dropout
            problems.append(
                f"{name} samples its experts in training ({module.sampling}): its random draws differ "
                "between the serial and the parallel model; set them to 0 (the best experts are then "
                "chosen) to verify it"
            )
            break
        if drops:
            attr, value = drops[0]
            problems.append(
                f"{name or type(model).__name__} has dropout ({attr}={value}): its random streams differ "
                "between the serial and the parallel model; build the model with dropout 0 to verify it"
            )
            break
    return problems


def _cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")


def _everywhere(
    full: dict[str, Tensor], shapes: Mapping[str, tuple[int, ...]], group: Group, device: torch.device
) -> dict[str, Tensor]:
    """Every pipeline rank's full tensors on every rank of ``group`` (the pipeline group): one
    all-reduce per parameter, zeros from the ranks that do not hold it, divided by the number
    of holders (a weight tied across stages is held twice)."""
    names = sorted(shapes)
    held = torch.tensor([float(n in full) for n in names], dtype=torch.float64, device=device)
    holders = all_reduce(held, group)
    out = {}
    for i, name in enumerate(names):
        mine = full[name].to(device) if name in full else torch.zeros(shapes[name], device=device)
        out[name] = (all_reduce(mine, group) / float(holders[i])).cpu()
    return out


class Verifier:
    """The serial copy of a model and the comparison of its first step with the parallel one
    (see the module docstring); ``done`` once a step was compared and matched."""

    def __init__(
        self, model: nn.Module, config: BoostConfig, *, loss: Loss | None, output: Callable[[Any], Tensor]
    ) -> None:
        problems = _unverifiable(model, config)
        if problems:
            raise ValueError("verify: cannot compare with a serial step: " + "; ".join(problems))
        memo: dict[int, Any] = {}
        self.model = copy.deepcopy(model, memo).float()
        self.precision = config.train.precision
        self.rtol = tolerance(self.precision)
        self.chunks = config.parallel.dp * config.parallel.microbatches
        # the layers' own router losses weigh 1 / chunks each, as the engine's scale and the dp
        # average weigh them in the parallel step (`tessera.moe.aux`)
        set_aux_grad_scale(self.model, 1.0 / self.chunks)
        self.loss = bound_to_copy(loss, memo) if loss is not None else _cross_entropy_sum
        self.given = True  # the parallel weights are still the model's own (no load since boost)
        self.sums = loss is None  # the built-in cross-entropy: a sum, over the batch's counted tokens
        self.output = output
        self.done = False
        self.seconds = 0.0
        self.serial_loss = float("nan")
        self.serial_grads: dict[str, Tensor] = {}

    def serial_step(self, engine: Boosted, inputs: Any, targets: Tensor) -> None:
        """Load the parallel weights into the copy and run its fp32 step on the global batch
        (collective: the weights are gathered over tp, dp and pp)."""
        start = time.perf_counter()
        mesh = engine.mesh
        full = local_full_parameters(engine)
        if mesh.size("pp") > 1:
            full = _everywhere(full, engine.placement.full_shapes, mesh.group("pp"), mesh.device)
        model = self.model
        named = dict(model.named_parameters())
        missing = sorted(set(named) - set(full))
        if missing:
            raise ValueError(f"verify: the boosted model lacks serial parameters {missing[:5]}")
        device = next(iter(named.values())).device
        if self.given:
            self._check_given(named, full, engine)
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(full[name])
        model.train()
        model.zero_grad(set_to_none=True)
        total = 0.0
        counted = float((targets != IGNORE_INDEX).sum()) if self.sums else float(self.chunks)
        ys = split_microbatches(targets, self.chunks, "targets")
        for x, y in zip(split_inputs(inputs, self.chunks), ys, strict=True):
            if isinstance(x, Tensor):
                out = model(x.to(device))
            else:
                out = model(**{k: v.to(device) for k, v in x.items()})
            loss = self.loss(self.output(out), y.to(device)) / counted
            torch.autograd.backward(loss)
            total += float(loss.detach())
        self.serial_loss = total
        self.serial_grads = {
            n: (torch.zeros_like(p) if p.grad is None else p.grad).to("cpu", torch.float32, copy=True)
            for n, p in named.items()
        }
        model.zero_grad(set_to_none=True)
        self.seconds += time.perf_counter() - start

    def weights_replaced(self) -> None:
        """The engine loaded other weights (a checkpoint, an import): the first step is then
        verified from those, without comparing them with the model given to ``boost``."""
        self.given = False

    def _check_given(self, named: Mapping[str, Tensor], full: Mapping[str, Tensor], engine: Boosted) -> None:
        """Before the first step, the parallel weights gathered by serial name must be the
        weights of the model given to ``boost`` (in the compute dtype): a parameter split,
        placed or shuffled wrongly (an expert bank's slice on the wrong rank) would otherwise
        train consistently from the wrong start and pass the gradient comparison."""
        mine = {n: full[n] for n in named if n in full}
        differ, _ = compare_gradients({n: p.detach().cpu() for n, p in named.items()}, mine, self.rtol)
        error = None
        if differ:
            error = ValueError(
                f"verify: before any step, {len(differ)} of {len(mine)} parallel weights differ from the "
                f"model given to boost() ({engine.mesh.topology.describe()}): "
                + "; ".join(str(d) for d in differ[:6])
                + "; a parameter was split, placed or converted wrongly; nothing was updated"
            )
        try:
            raise_together(error, None, "verify", engine.mesh.device)
        except RemoteFailure as e:
            raise ValueError(str(e)) from None

    @contextlib.contextmanager
    def comparing(self, engine: Boosted, local_loss: float) -> Iterator[None]:
        """Around ``ZeroOptimizer.step``: compare before the optimizer steps (raises on every
        rank on a mismatch); a skipped step leaves ``done`` False, to verify the next one."""
        handle = engine.zero.optimizer.register_step_pre_hook(lambda *_: self._compare(engine, local_loss))
        try:
            yield
        finally:
            handle.remove()
        if not self.done:
            log.warning("verify: the first step was skipped (non-finite gradient norm); verifying the next")

    def _compare(self, engine: Boosted, local_loss: float) -> None:
        start = time.perf_counter()
        mesh, zero = engine.mesh, engine.zero
        grads = local_full_gradients(engine)
        clip = zero.config.clip_grad_norm
        if clip is not None and zero.last_grad_norm is not None:  # compared before clipping
            coefficient = clip_coefficient(zero.last_grad_norm, clip)
            grads = {n: g / coefficient for n, g in grads.items()}
        loss_t = torch.tensor([local_loss], dtype=torch.float64, device=mesh.device)
        loss = float(all_reduce(loss_t, mesh.group("dp"), "avg")[0])
        loss_rel = abs(loss - self.serial_loss) / max(abs(self.serial_loss), 1e-12)
        differ, worst = compare_gradients(self.serial_grads, grads, self.rtol)
        what = f"{mesh.topology.describe()}, {self.precision}, rtol {self.rtol:.2g}"
        error = None
        if differ or not loss_rel <= self.rtol:
            error = ValueError(
                f"verify: the parallel step differs from the serial one ({what}); nothing was updated. "
                f"Loss {loss:.6g} (serial {self.serial_loss:.6g}, rel {loss_rel:.3g}); "
                f"{len(differ)} of {len(grads)} gradients differ: " + "; ".join(str(d) for d in differ[:6])
            )
        try:
            raise_together(error, None, "verify", mesh.device)
        except RemoteFailure as e:
            raise ValueError(str(e)) from None
        self.seconds += time.perf_counter() - start
        self.done = True
        self.serial_grads = {}
        log.info(
            "verify: the first step equals the serial one (%s): loss %.6g (serial %.6g, rel %.2g), "
            "%d gradients on this rank, worst %s; cost %.2f s",
            what,
            loss,
            self.serial_loss,
            loss_rel,
            len(grads),
            worst if worst is not None else "none",
            self.seconds,
        )
