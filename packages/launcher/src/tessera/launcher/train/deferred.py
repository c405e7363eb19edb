"""Deferred initialization: build a model without parameter storage, then let each rank
materialize only the parameters it holds, with the values an eager build would get.

``with deferred_parameters(): model = MyModel()`` runs the constructor as usual, but every
parameter a module registers is moved to the meta device at once (buffers stay real: rotary
tables, masks), so building costs one parameter's memory at a time, never the model's.
``boost`` sees meta parameters and, after tensor parallelism and the pipeline cut, hands
the ones this rank holds to ZeRO still on the meta device; ZeRO asks ``DeferredValues`` for
each as it fills its flat buffers, one at a time (with the chunk manager, each goes to its
chunks, on disk if so placed, before the next is made): for a module that owns some, one
full-size copy of that module's own parameters is initialized on the host by
``init(name, module)`` under a generator seeded by ``seed`` and the module's name, and this
rank keeps its shard of each. No rank ever holds more than one module's full values and
one flat buffer besides its own shards.
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
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from tessera.launcher.checkpoint.exported import ExportPart, assemble
from tessera.launcher.checkpoint.placement import local_part
from tessera.tensor_parallel import shard_specs

__all__ = ["DeferredValues", "InitFn", "default_init", "deferred_parameters", "has_deferred", "init_by_name"]

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


class DeferredValues:
    """The value of each meta parameter of ``model`` (tensor-parallel and cut already), asked
    for by ZeRO as it fills its flat buffers (``ZeroOptimizer(init=...)``): this rank's shard
    of the full value initialized on ``serial`` (a deep copy of the deferred model taken
    before it was converted; module names are serial names), cut as ``parallelize`` split
    that parameter (``shard_specs(model)``, the same specs checkpoints reshard by, for every
    tensor-parallel mode: 1D slices, the 2D / 2.5D / 3D grids' blocks) for tensor-parallel
    rank ``tp_rank`` of ``tp``, after taking the experts ``(start, stop)`` of an expert bank
    this rank holds (``experts``: by parameter name, ``expert_slices``); a parameter neither
    names is whole. A parameter boost() trains under a name of its own (a user's or an HF
    mixture converted to ``tessera.moe.MoE``: ``exported``) is assembled from the serial model's
    parameters it exports as (`tessera.launcher.checkpoint.exported.assemble`), each made as
    for any other parameter: an HF bank's ``w1`` / ``w3`` are the gate / up rows of the
    ``experts.gate_up_proj`` that the model's ``_init_weights`` draws for its experts module
    (normal, ``initializer_range``), transposed, so they equal an eager build's converted
    values element for element. A module's values are
    made once for all its parameters (kept until another module's are asked for).
    ``made``: the number of elements given so far."""

    def __init__(
        self,
        serial: nn.Module,
        model: nn.Module,
        *,
        seed: int,
        init: InitFn | None = None,
        tp_rank: int = 0,
        tp: int = 1,
        experts: Mapping[str, tuple[int, int]] | None = None,
        exported: Mapping[str, tuple[ExportPart, ...]] | None = None,
    ) -> None:
        self._serial = serial
        self._specs = shard_specs(model)
        self._experts = dict(experts or {})
        self._exported = dict(exported or {})
        self._tp_rank, self._tp = tp_rank, tp
        self._seed = seed
        self._init = init if init is not None else default_init(serial)
        self._names = {id(p): name for name, p in model.named_parameters() if p.is_meta}  # a tied one once
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None
        self.made = 0

    def __call__(self, param: nn.Parameter) -> torch.Tensor:
        name = self._names.get(id(param))
        if name is None:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} is not a deferred parameter of the model"
            )
        parts = self._exported.get(name)
        full = self._value(name) if parts is None else assemble(parts, [self._value(p.name) for p in parts])
        try:
            part = local_part(full, name, self._specs, self._experts, self._tp_rank, self._tp, param.shape)
        except ValueError as exc:
            raise ValueError(f"deferred initialization: {exc}") from None
        self.made += part.numel()
        return part

    def _value(self, name: str) -> torch.Tensor:
        """The full value of the serial model's parameter ``name``."""
        owner, _, pname = name.rpartition(".")
        if self._last is None or self._last[0] != owner:
            self._last = None  # the previous module's values go first
            try:
                module = self._serial.get_submodule(owner)
            except AttributeError:
                raise ValueError(f"deferred initialization found no serial module for {name}") from None
            self._last = (owner, _initialized(module, owner, self._seed, self._init))
        return self._last[1][pname]
