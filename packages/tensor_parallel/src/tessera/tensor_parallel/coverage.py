"""Coverage: every parameter of a parallelized model is accounted for, none left partial.

After ``parallelize`` each parameter is either split by its module's style (its shard spec
says how) or kept whole on every tp rank. A whole parameter's gradient is *complete* (the
same on every rank, the serial one) only where every rank computes it from the same whole
activations; elsewhere each rank's gradient is a *partial sum* that must be summed over the
tp group before the optimizer steps. The rule, decided before anything runs:

- 1D, without sequence parallelism: complete outside every ``region``/``attention`` module;
  inside one (its input entered the tp region, so what reaches it backward is one rank's
  share: a q/k norm over split heads, a norm in front of the column layers) partial.
- 1D with sequence parallelism: also partial outside regions (the residual stream holds
  this rank's slice of the sequence: the norms Megatron marks).
- 2D, 2.5D, 3D: every element of an activation lives on exactly one rank, so every whole
  parameter is partial.
- A self-contained region (``plan.self_contained``, e.g. a mixture of experts split inside
  its experts) declares every parameter inside it: split where its ``shard_spec`` says,
  partial otherwise.
- A style may say better for its module's parameters: ``grad_complete = True`` (e.g.
  ``sequence_split``, whose output is split after the module, so backward all-gathers its
  whole gradient; ``replicate``, the user's word that the module sees whole activations);
  ``after_exit = True`` (``adapters.AfterExit``: applied to a region's summed output, so
  complete, and partial only under SP).

Partial parameters are tagged (``sequence.mark_sequence_parallel``) so that
``sync_sequence_parallel_grads`` sums exactly them; ``parallelize`` logs, once, those the
plan did not name. ``tp_gradient_problems`` is the proof at run time: on one backward,
before the sum, a complete gradient must be the same on every tp rank and a partial one
must not be (a gradient already complete would be summed tp times over).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tessera.comm import Group, all_reduce
from tessera.tensor_parallel.plan import Assignment, assigned_spec
from tessera.tensor_parallel.sequence import is_sequence_parallel
from tessera.tensor_parallel.style import Role

__all__ = ["Coverage", "cover", "tp_gradient_problems"]


@dataclass(frozen=True, slots=True)
class Coverage:
    """Serial parameter names of a parallelized model: split by a style, whole with a complete
    gradient, whole with a partial one (with why), and which partial ones no plan entry named."""

    split: tuple[str, ...]
    complete: tuple[str, ...]
    partial: Mapping[str, str]
    undeclared: tuple[str, ...]

    def describe_undeclared(self) -> str:
        """The undeclared partial parameters collapsed to plan-style patterns (layer numbers
        as ``*``), each with its reason."""
        seen: dict[str, str] = {}
        for name in self.undeclared:
            pattern = re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)
            seen.setdefault(pattern, self.partial[name])
        return "; ".join(f"{p} ({why})" for p, why in seen.items())


def _within(name: str, ancestor: str) -> bool:
    return name == ancestor or name.startswith(ancestor + ".")


def cover(
    model: nn.Module, assignments: Iterable[Assignment], *, sequence_parallel: bool, every_element_once: bool
) -> Coverage:
    """Classify every parameter of the serial ``model`` under ``assignments`` (pure; call it
    before converting). ``every_element_once``: the mode places each activation element on one
    rank only (2D, 2.5D, 3D)."""
    by_name = {a.name: a for a in assignments}
    regions = [a.name for a in by_name.values() if a.style.role is Role.REGION]
    split, complete, undeclared = [], [], []
    partial: dict[str, str] = {}
    for full, _ in model.named_parameters():
        owner = full.rpartition(".")[0]
        a, spec = assigned_spec(by_name, model, full)  # a self-contained region decides inside it
        if spec is not None:
            split.append(full)
            continue
        if a is not None and getattr(a.style, "grad_complete", False):
            complete.append(full)
            continue
        region = next((r for r in regions if _within(owner, r)), None)
        if a is not None and a.style.role in (Role.ENTER, Role.EXIT) and not every_element_once:
            reason = None  # the parallel linear keeps its whole bias right itself (tagged under SP)
        elif a is not None and getattr(a.style, "after_exit", False) and not every_element_once:
            reason = "in the sequence-parallel stream" if sequence_parallel else None
        elif every_element_once:
            reason = "each rank holds a block of every activation"
        elif region is not None:
            reason = f"inside the tp region {region}"
        elif sequence_parallel:
            reason = "in the sequence-parallel stream"
        else:
            reason = None
        if reason is None:
            complete.append(full)
            continue
        partial[full] = reason
        if a is None:
            undeclared.append(full)
    return Coverage(tuple(split), tuple(complete), partial, tuple(undeclared))


def _fingerprints(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    rows = []
    for p in params:
        g = p.grad
        if g is None:
            rows.append(torch.zeros(2, dtype=torch.float64, device=device))
        else:
            g64 = g.detach().to(torch.float64)
            rows.append(torch.stack([g64.sum(), g64.abs().sum()]).to(device))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64, device=device)


def tp_gradient_problems(named: Mapping[str, nn.Parameter], group: Group, *, rtol: float = 1e-5) -> list[str]:
    """Check, on one backward and before partial gradients are summed, that each whole
    parameter in ``named`` (serial name -> parameter; pass only those no style split) has the
    gradient its tag says: untagged ones the same on every rank of ``group``, tagged
    (partial) ones not already the same. Returns one line per offending parameter (empty:
    all good). Collective over ``group``: two all-reduces of 2 float64 numbers per parameter.
    """
    names = sorted(named)
    params = [named[n] for n in names]
    device = params[0].device if params else torch.device("cpu")
    local = _fingerprints(params, device)
    high, low = all_reduce(local, group, "max"), all_reduce(local, group, "min")
    problems = []
    for i, name in enumerate(names):
        scale = float(high[i, 1].abs().max())
        if scale == 0.0:
            continue  # no gradient anywhere: nothing to tell
        spread = float((high[i] - low[i]).abs().max()) / scale
        tagged = is_sequence_parallel(params[i])
        if not tagged and spread > rtol:
            problems.append(
                f"{name}: kept whole, but its gradient differs across tp ranks (relative spread "
                f"{spread:.2e}): it is a partial sum; give its module a plan entry that sums it "
                "(e.g. 'sequence_norm' for a norm)"
            )
        elif tagged and spread <= rtol:
            problems.append(
                f"{name}: its gradient would be summed over tp, but it is already the same on every "
                "rank (complete): it acts on whole activations (e.g. after a region's exit); hold it "
                "in a module of its own and give that module the plan entry 'replicate'"
            )
    return problems
