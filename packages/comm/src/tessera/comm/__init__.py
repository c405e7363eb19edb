"""tessera.comm: topology, process-group mesh, differentiable collectives, p2p and meters.

The bottom layer of Tessera; depends on torch and numpy only. Test support lives in
``tessera.comm.testing``. Exports the public API only; ``gloo_ring`` (the rings behind the
gloo collectives) and ``files.atomic_write`` are imported from their modules.

Importing the package does not import torch: the pure half (`Topology`, `TPGrid`,
`integer_root`, `Axis`, `TPMode`, `configure_logging`, `RankFilter`) is loaded at once,
everything else on first use (PEP 562 ``__getattr__``), so a launcher can validate a
configuration in a fraction of a second and refuse it before torch loads.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tessera.comm.degrees import DEGREE_NAMES, PARALLELISM_NAMES, Degrees, Parallelism
from tessera.comm.geometry import TPGrid, integer_root
from tessera.comm.logs import RankFilter, configure_logging
from tessera.comm.topology import Axis, Topology, TPMode

if TYPE_CHECKING:
    from tessera.comm.collectives import (
        Group,
        Handle,
        all_gather,
        all_gather_async,
        all_reduce,
        all_reduce_async,
        all_to_all,
        all_to_all_rows,
        broadcast,
        broadcast_async,
        group_rank,
        group_size,
        overlappable,
        reduce_scatter,
        reduce_scatter_async,
    )
    from tessera.comm.memory import MemoryReport, measure_memory, storage_bytes
    from tessera.comm.mesh import Mesh, default_device
    from tessera.comm.meters import CommMeter, CommOp, CommRecord
    from tessera.comm.ops import (
        all_gather_along,
        all_to_all_along,
        broadcast_from,
        copy_to_region,
        gather_along,
        reduce_from_region,
        reduce_scatter_along,
        split_along,
    )
    from tessera.comm.p2p import (
        batch_isend_irecv,
        has_p2p,
        recv,
        ring_shift,
        ring_shift_async,
        send,
        share_memory,
    )

# the submodules that need torch: the names of __all__ not imported above come from them
_LAZY = ("collectives", "memory", "mesh", "meters", "ops", "p2p")


class _LazyPackage(types.ModuleType):
    """A package module whose exported names are never shadowed by the submodule of the same
    name (the import system sets each submodule it loads as an attribute of its package)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
            and name in self.__dict__.get("__all__", ())
        ):
            return
        super().__setattr__(name, value)


def lazy_exports(
    package: str, modules: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """PEP 562 ``__getattr__`` and ``__dir__`` for ``package``: a name of its ``__all__`` that
    is not yet bound is imported, on first use, from the first of ``modules`` (submodule
    names) that defines it, then kept. A submodule named like an exported name (``boost``
    the module, ``boost`` the function) does not hide it."""
    module = sys.modules[package]
    namespace = module.__dict__
    module.__class__ = _LazyPackage

    def getattr_(name: str) -> Any:
        if name in namespace.get("__all__", ()):
            for source in modules:
                loaded = importlib.import_module(f"{package}.{source}")
                if hasattr(loaded, name):
                    namespace[name] = getattr(loaded, name)
                    return namespace[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return getattr_, dir_


if not TYPE_CHECKING:  # hidden from mypy, which then checks every name as imported above
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__version__ = "0.1.0"

__all__ = [
    "DEGREE_NAMES",
    "PARALLELISM_NAMES",
    "Axis",
    "CommMeter",
    "CommOp",
    "CommRecord",
    "Degrees",
    "Group",
    "Handle",
    "MemoryReport",
    "Mesh",
    "Parallelism",
    "RankFilter",
    "TPGrid",
    "TPMode",
    "Topology",
    "all_gather",
    "all_gather_along",
    "all_gather_async",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_along",
    "all_to_all_rows",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_async",
    "broadcast_from",
    "configure_logging",
    "copy_to_region",
    "default_device",
    "gather_along",
    "group_rank",
    "group_size",
    "has_p2p",
    "integer_root",
    "lazy_exports",
    "measure_memory",
    "overlappable",
    "recv",
    "reduce_from_region",
    "reduce_scatter",
    "reduce_scatter_along",
    "reduce_scatter_async",
    "ring_shift",
    "ring_shift_async",
    "send",
    "share_memory",
    "split_along",
    "storage_bytes",
]
