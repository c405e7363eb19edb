"""What ``boost()`` rebuilds around the user's objects: the optimizer over the parameters a rank
still holds, its groups by serial name, the chunk memory manager's settings, and the release of
the parameters other pipeline ranks hold."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from tessera.launcher.config import BoostConfig
from tessera.zero import ChunkConfig

__all__ = ["chunk_config", "groups_by_name", "rebuild_optimizer", "release_others", "tied_aliases"]


def chunk_config(config: BoostConfig, rank: int) -> ChunkConfig | None:
    """The chunk memory manager's settings for global rank ``rank`` (None when the job does not
    use it); each rank's disk chunks go under ``<zero.disk_dir>/rank<k>``."""
    z = config.zero
    if not z.chunked:
        return None
    return ChunkConfig(
        device_budget_mb=z.device_budget_mb or None,
        host_budget_mb=z.host_budget_mb or None,
        disk_dir=Path(z.disk_dir) / f"rank{rank}" if z.disk_dir else None,
        policy=z.policy,
        fractions=(z.fractions[0], z.fractions[1], z.fractions[2]) if z.fractions else None,
        chunk_numel=z.chunk_numel or None,
        step_in_backward=z.step_in_backward,
    )


def release_others(params: Iterable[nn.Parameter], keep: set[int]) -> None:
    """Empty the parameters other pipeline ranks hold: the caller's model still references
    every block, and without this each rank would keep the whole serial model resident."""
    with torch.no_grad():
        for param in params:
            if id(param) not in keep:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                param.grad = None


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, local: Mapping[str, nn.Parameter], group_of: Mapping[str, int]
) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class, with the same parameter groups and hyperparameters,
    over this rank's parameters ``local`` (by serial name; ``group_of`` maps a serial name to
    its group in ``optimizer``, and leaves out the frozen ones, which it does not hold).

    Tensor and pipeline parallelism replace or drop parameters, so the user's optimizer is
    rebuilt over what this rank holds (a group may be empty on a pipeline rank); it must hold
    no state yet. Adam/AdamW on torch's default implementation are rebuilt fused
    (``_prefers_fused``).
    """
    if optimizer.state:
        raise ValueError("boost() needs a fresh optimizer (it already holds state)")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params" and k in accepted},
            "params": [p for name, p in local.items() if group_of.get(name) == index],
        }
        for index, group in enumerate(optimizer.param_groups)
    ]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if _prefers_fused(optimizer):
        defaults["fused"] = True
        for group in groups:
            group["fused"], group["foreach"] = True, None
    return type(optimizer)(groups, **defaults)


def _prefers_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Adam and AdamW left on torch's default implementation (neither ``foreach`` nor
    ``fused`` given, for any group) step ZeRO's flat shards with the fused kernel: one large
    flat tensor is where the default multi-tensor path is slowest (5M elements here: 84 ms
    against 8.8 ms fused; the results differ from it only in the last bit of some elements)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    settings = [optimizer.defaults, *optimizer.param_groups]
    return all(s.get("fused") is None and s.get("foreach") is None for s in settings)


def groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The optimizer group of every trainable parameter of ``model``, by serial name
    (ValueError naming the parameters the optimizer lacks or holds twice, or holds beyond
    the model). A frozen parameter (``requires_grad=False``) may be in the optimizer or not:
    it is never stepped (ZeRO keeps it, sharded like the others)."""
    names = dict(model.named_parameters())
    trained = {n: p for n, p in names.items() if p.requires_grad}
    index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    missing = [n for n, p in trained.items() if id(p) not in index]
    held = {id(p) for p in names.values()}
    if missing or count != len(index) or set(index) - held:
        raise ValueError(
            f"boost() needs an optimizer over every trainable parameter of the model, each once: "
            f"missing {missing[:5]}, {count - len(index)} held twice, "
            f"{len(set(index) - held)} not in the model"
        )
    return {n: index[id(p)] for n, p in trained.items()}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every further name under which the model's state dict holds a parameter it already
    names (a tied LM head), mapped to the parameter's name in ``named_parameters``."""
    first = {id(p): n for n, p in model.named_parameters()}
    every = model.named_parameters(remove_duplicate=False)
    return {n: first[id(p)] for n, p in every if first[id(p)] != n}
