"""The process groups of a Topology, handed out by axis name.

A Mesh is built collectively (every rank constructs it, in the same order, after
``torch.distributed`` is initialised) and owns its groups: ``close()`` destroys them. The
four main axes come from a torch ``DeviceMesh`` of shape (pp, dp, cp, tp), so DTensor-based
code can share it; tp sub-axes, the expert axes ``ep`` and ``edp`` (when the topology has
ep > 1) and combined axes are extra groups over the same ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tessera.comm.topology import Axis, Topology

__all__ = ["Mesh", "default_device"]

AxisKey = str | tuple[str, ...]


def default_device() -> torch.device:
    """The device the default backend serves: the current accelerator under NCCL-like
    backends, the CPU under gloo and the threaded test backend."""
    backend = str(dist.get_backend())
    if backend in ("gloo", "threaded") or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _key(axes: str | Iterable[str]) -> AxisKey:
    if isinstance(axes, str):
        return Axis(axes).value
    names = tuple(sorted(Axis(a).value for a in axes))
    return names[0] if len(names) == 1 else names


class Mesh:
    """Process groups for every axis of ``topology`` on the initialised default group.

    ``combined`` lists extra axis combinations to build groups for, e.g. ``[("dp", "cp")]``
    for sharding over data and sequence ranks together. Raises ValueError before any group
    is made if the world size does not match the topology.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        combined: Sequence[Sequence[str]] = (),
        timeout: timedelta | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed to be initialised first")
        topology.check_world_size(dist.get_world_size())
        self.topology = topology
        self.rank = dist.get_rank()
        self.device = device if device is not None else default_device()
        names = ("pp", "dp", "cp", "tp")
        self.device_mesh = DeviceMesh(
            self.device.type,
            torch.arange(topology.world_size).reshape(topology.pp, topology.dp, topology.cp, topology.tp),
            mesh_dim_names=names,
        )
        self._groups: dict[AxisKey, dist.ProcessGroup] = {
            n: self.device_mesh.get_group(n) for n in names
        }
        self._owned: list[dist.ProcessGroup] = []
        extra: list[AxisKey] = [a.value for a in topology.axes if a.value not in self._groups]
        extra += [_key(c) for c in combined]
        for key in extra:
            if key in self._groups:
                continue
            mine = None
            for ranks in topology.groups(key):
                group = dist.new_group(list(ranks), timeout=timeout)
                self._owned.append(group)
                if self.rank in ranks:
                    mine = group
            assert mine is not None
            self._groups[key] = mine

    def group(self, axes: str | Iterable[str]) -> dist.ProcessGroup:
        """This rank's group along one axis (e.g. "tp", "tp_row") or a built combination."""
        key = _key(axes)
        if key not in self._groups:
            raise KeyError(f"no group for {key!r}; built: {sorted(map(str, self._groups))}")
        return self._groups[key]

    def ranks(self, axes: str | Iterable[str]) -> tuple[int, ...]:
        """The global ranks of this rank's group along ``axes``."""
        return self.topology.group_of(self.rank, list(_as_tuple(_key(axes))))

    def size(self, axes: str | Iterable[str]) -> int:
        """The number of ranks in a group along ``axes``."""
        return self.topology.size(list(_as_tuple(_key(axes))))

    def coordinate(self, axes: str | Iterable[str]) -> int:
        """This rank's index inside its group along ``axes``."""
        return self.topology.coordinate(self.rank, list(_as_tuple(_key(axes))))

    def close(self) -> None:
        """Destroy every group this mesh created, its DeviceMesh's included (never the default
        group), so a long-lived process that builds mesh after mesh holds no stale groups.
        The mesh is unusable afterwards; closing twice is harmless."""
        live = dist.distributed_c10d._world.pg_map
        mine = {id(g): g for g in [*self._groups.values(), *self._owned]}
        for group in mine.values():
            if group is not dist.group.WORLD and group in live:
                dist.destroy_process_group(group)
        self._owned.clear()
        self._groups.clear()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Mesh(rank={self.rank}, {self.topology.describe()}, device={self.device})"


def _as_tuple(key: AxisKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else key
