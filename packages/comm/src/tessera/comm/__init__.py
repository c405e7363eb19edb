"""tessera.comm: topology, process-group mesh, differentiable collectives, p2p and meters.

The bottom layer of Tessera; depends on torch and numpy only. Test support lives in
``tessera.comm.testing``. Exports the public API only; ``gloo_ring`` (the rings behind the
gloo collectives) and ``files.atomic_write`` are imported from their modules.
"""

from tessera.comm.collectives import (
    Group,
    Handle,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    broadcast,
    group_rank,
    group_size,
    reduce_scatter,
    reduce_scatter_async,
)
from tessera.comm.logs import RankFilter, configure_logging
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
from tessera.comm.p2p import batch_isend_irecv, recv, ring_shift, ring_shift_async, send
from tessera.comm.topology import Axis, Topology, TPMode

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "CommMeter",
    "CommOp",
    "CommRecord",
    "Group",
    "Handle",
    "MemoryReport",
    "Mesh",
    "RankFilter",
    "TPMode",
    "Topology",
    "all_gather",
    "all_gather_along",
    "all_gather_async",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_along",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_from",
    "configure_logging",
    "copy_to_region",
    "default_device",
    "gather_along",
    "group_rank",
    "group_size",
    "measure_memory",
    "recv",
    "reduce_from_region",
    "reduce_scatter",
    "reduce_scatter_along",
    "reduce_scatter_async",
    "ring_shift",
    "ring_shift_async",
    "send",
    "split_along",
    "storage_bytes",
]
