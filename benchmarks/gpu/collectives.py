"""Which of ``tessera.comm``'s collectives a process group carries on the run's device.

On one GPU a world of several ranks runs over gloo with CUDA tensors, and gloo implements
only some collectives for them. Each probe here is one collective of ``tessera.comm`` (what
the modes call) on 2 ranks, checked against the values it must produce (integers in fp32:
exact), so a mode's failure can be told apart from a collective the backend lacks.
"""

from __future__ import annotations

import torch

from tessera import comm

__all__ = ["PROBES", "probe"]

PROBES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "ring_shift")


def probe(rank: int, name: str, device: str) -> dict[str, object]:
    """Run collective ``name`` on this rank's ``device`` tensors; True when exact."""
    n = comm.group_size(None)

    def values(r: int) -> torch.Tensor:  # rank r's input, on the CPU
        return torch.arange(4 * n, dtype=torch.float32) + 100 * r

    x = values(rank).to(device)
    total = sum((values(r) for r in range(n)), torch.zeros(4 * n))
    if name == "all_reduce":
        got, want = comm.all_reduce(x), total
    elif name == "broadcast":
        got, want = comm.broadcast(x, 0), values(0)
    elif name == "all_gather":
        got, want = comm.all_gather(x), torch.cat([values(r) for r in range(n)])
    elif name == "reduce_scatter":
        got, want = comm.reduce_scatter(x), total.chunk(n)[rank]
    elif name == "all_to_all":
        got, want = comm.all_to_all(x), torch.cat([values(r).chunk(n)[rank] for r in range(n)])
    else:
        got, want = comm.ring_shift_async(x).wait(), values((rank - 1) % n)
    return {"exact": bool(torch.equal(got.cpu(), want)), "result_device": str(got.device)}
