"""Deferred initialization: build a model without parameter storage, then let each rank
materialize only the parameters it holds, with the values an eager build would get.

``with deferred_parameters(): model = MyModel()`` runs the constructor as usual, but every
parameter a module registers is moved to the meta device at once (buffers stay real: rotary
tables, masks), so building costs one parameter's memory at a time, never the model's.
``boost`` sees meta parameters and, after tensor parallelism and the pipeline cut, fills
the ones this rank holds: for each module that owns some, one full-size copy of that
module's own parameters is initialized on the host by ``init(name, module)`` under a
generator seeded by ``seed`` and the module's name, and this rank keeps its shard of each.
``init_by_name(model, seed)`` applies the same initialization to an eagerly built model:
the serial reference, equal to the deferred run element for element in every layout.

The default ``init`` is the model's Hugging Face ``_init_weights(module)`` if it has one,
else ``module.reset_parameters()``; a module with neither, or whose parameters the init left
partly untouched, is refused by name (pass ``boost(..., init=fn)``).
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tessera.tensor_parallel import shard_of

__all__ = ["InitFn", "default_init", "deferred_parameters", "has_deferred", "init_by_name", "materialize"]

InitFn = Callable[[str, nn.Module], None]


@contextlib.contextmanager
def deferred_parameters() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (buffers stay real)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    setattr(nn.Module, "register_parameter", register)  # noqa: B010 - a method patched, undone below
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", original)  # noqa: B010


def has_deferred(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device."""
    return any(p.is_meta for p in model.parameters())


def default_init(model: nn.Module) -> InitFn:
    """``model._init_weights(module)`` (Hugging Face), else ``module.reset_parameters()``."""
    hf = getattr(model, "_init_weights", None)

    def init(name: str, module: nn.Module) -> None:
        if callable(hf):
            hf(module)
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            own = ", ".join(n for n, _ in module.named_parameters(recurse=False))
            raise ValueError(
                f"{name or 'the model'} ({type(module).__name__}) holds parameters {own} but has no "
                "reset_parameters(): give boost(..., init=fn) to initialize it"
            )
        reset()

    return init


@contextlib.contextmanager
def _seeded(seed: int, name: str) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        yield


def _initialized(module: nn.Module, name: str, seed: int, init: InitFn) -> dict[str, torch.Tensor]:
    """The full values of ``module``'s own parameters, initialized on the host (a shallow copy
    holds them; children and buffers are the module's own)."""
    shell = copy.copy(module)
    shell._parameters = {  # None entries too (a Linear without bias reads ``self.bias``)
        pname: None
        if p is None
        else nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad)
        for pname, p in module._parameters.items()
    }
    with _seeded(seed, name), torch.no_grad():
        init(name, shell)
    out = {pname: p.detach() for pname, p in shell._parameters.items() if p is not None}
    untouched = [pname for pname, t in out.items() if t.is_floating_point() and bool(t.isnan().any())]
    if untouched:
        raise ValueError(
            f"{name or 'the model'} ({type(module).__name__}): the init left {', '.join(untouched)} "
            "(partly) uninitialized; give boost(..., init=fn) that sets every parameter"
        )
    return out


def init_by_name(model: nn.Module, seed: int, init: InitFn | None = None) -> nn.Module:
    """Initialize an eagerly built ``model`` in place as ``materialize`` does a deferred one."""
    init = init if init is not None else default_init(model)
    done: set[int] = set()  # a shared parameter takes the value of the first module holding it
    with torch.no_grad():
        for name, module in model.named_modules():
            own = {pn: p for pn, p in module._parameters.items() if p is not None and id(p) not in done}
            if own:
                values = _initialized(module, name, seed, init)
                for pname, param in own.items():
                    param.copy_(values[pname])
                    done.add(id(param))
    return model


def materialize(
    serial: nn.Module,
    model: nn.Module,
    *,
    seed: int,
    device: torch.device,
    holds: Callable[[nn.Parameter], bool],
    init: InitFn | None = None,
) -> int:
    """Give every meta parameter of ``model`` that ``holds`` accepts its real value: this
    rank's shard (``shard_of``) of the full value initialized on ``serial`` (a deep copy of
    the deferred model taken before it was converted; module names are serial names).
    A parameter several modules share is replaced once, everywhere. Returns the number
    of elements made."""
    init = init if init is not None else default_init(serial)
    owners: dict[str, list[tuple[nn.Module, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None and p.is_meta and holds(p):
                owners.setdefault(f"{mname}.{pname}" if mname else pname, []).append((module, pname))
    made: dict[int, nn.Parameter] = {}
    total = 0
    for mname, module in serial.named_modules():
        wanted = [pn for pn in module._parameters if (f"{mname}.{pn}" if mname else pn) in owners]
        if not wanted:
            continue
        values = _initialized(module, mname, seed, init)
        for pname in wanted:
            full_name = f"{mname}.{pname}" if mname else pname
            holders = owners[full_name]
            old = holders[0][0]._parameters[holders[0][1]]
            assert old is not None
            if id(old) not in made:
                part = shard_of(model, full_name, values[pname]).to(device=device, dtype=old.dtype)
                made[id(old)] = nn.Parameter(part.contiguous(), requires_grad=old.requires_grad)
                total += part.numel()
            for owner, attr in holders:
                owner._parameters[attr] = made[id(old)]
    left = sorted(name for name, p in model.named_parameters() if p.is_meta and holds(p))
    if left:
        raise ValueError(f"deferred initialization found no serial module for {', '.join(left[:5])}")
    return total
