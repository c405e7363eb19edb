"""Shared-memory CPU collectives (``tessera.comm.shm``).

Tier 1 (pure): ``TESSERA_SHM``'s values. Tier 2 (gloo worker processes, one host): every
collective against a single-process reference with slots small enough that a tensor goes
in many pieces; groups whose ranks do not all share a host (one rank pretends it is on
another) keep gloo and stay right; nothing is left in ``/dev/shm``; a peer that dies while
the others wait in a collective fails them at once, naming it, instead of hanging them.

Tolerances: fp32 sums of at most 3 summands in rank order (the reference adds in the same
order: exact); bf16 likewise exact against a bf16 reference added in rank order; int64 exact.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
    share_memory,
    shm,
    shm_p2p,
)
from tessera.comm.shm_env import ENV, enabled_from_env
from tessera.comm.testing import RankFailure, WorkerPool
from tessera.comm.testing.fixtures import PoolFactory


@pytest.mark.parametrize(
    ("raw", "on"), [("auto", True), ("1", True), (" On ", True), ("0", False), ("off", False)]
)
def test_the_variable_turns_shared_memory_on_or_off(raw: str, on: bool) -> None:
    assert enabled_from_env({ENV: raw}) is on
    assert enabled_from_env({}) is True


@pytest.mark.parametrize("raw", ["yes", "", "2"])
def test_a_bad_value_is_refused_by_name(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV}="):
        enabled_from_env({ENV: raw})


def _pieces(rank: int, xs: list[Tensor], op: str, slots_bytes: int) -> dict[str, object]:
    """Every collective on a fresh group whose segment has ``slots_bytes`` of slots."""
    n = dist.get_world_size()
    default, shm.SLOTS_BYTES = shm.SLOTS_BYTES, slots_bytes
    try:
        group = dist.new_group(list(range(n)))
        segment = shm.applies(xs[rank], group)
    finally:
        shm.SLOTS_BYTES = default
    x = xs[rank]
    return {
        "slot_bytes": None if segment is None else segment.slot_bytes,
        "all_reduce": all_reduce(x, group, op),  # type: ignore[arg-type]
        "all_gather": all_gather(x, group),
        "reduce_scatter": reduce_scatter(torch.cat([x] * n), group, op=op),  # type: ignore[arg-type]
        "broadcast": broadcast(x, n - 1, group),
        "all_to_all": all_to_all(torch.stack([x * (j + 1) for j in range(n)]), group),
    }


def _fold(xs: list[Tensor], op: str) -> Tensor:
    """The reduction in rank order, in the tensors' dtype, as the segment computes it."""
    fn = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    out = fn(xs[0], xs[1])
    for x in xs[2:]:
        out = fn(out, x)
    return out / len(xs) if op == "avg" else out


@settings(max_examples=12, deadline=None)
@given(
    n=st.sampled_from([2, 3]),
    numel=st.integers(1, 5000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    op=st.sampled_from(["sum", "avg", "max", "min"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_collectives_in_many_pieces_equal_the_reference(
    worker_pools: PoolFactory, n: int, numel: int, dtype: torch.dtype, op: str, seed: int
) -> None:
    if dtype == torch.int64 and op == "avg":
        op = "sum"  # an integer average is not what gloo computes either
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(numel, generator=gen) * 100).to(dtype) for _ in range(n)]
    slots_bytes = 2 * n * 256  # 256-byte slots: up to 64 fp32 elements a piece
    for rank, got in enumerate(worker_pools(n).run(_pieces, xs, op, slots_bytes)):
        assert got["slot_bytes"] == 256, "the group did not get a shared-memory segment"
        total = _fold(xs, op)
        checks = {
            "all_reduce": total,
            "all_gather": torch.cat(xs),
            "reduce_scatter": total,
            "broadcast": xs[n - 1],
            "all_to_all": torch.stack([xs[q] * (rank + 1) for q in range(n)]),
        }
        for name, want in checks.items():
            have = got[name]
            assert isinstance(have, Tensor) and have.dtype == dtype, name
            assert torch.equal(have, want), f"{name} on rank {rank} of {n}: {have} != {want}"


def _other_host(rank: int) -> tuple[bool, Tensor, Tensor]:
    default = shm._host_id
    if rank == 1:
        shm._host_id = lambda: "another-host/0"  # type: ignore[assignment]
    try:
        group = dist.new_group([0, 1])
        x = torch.arange(6.0) * (rank + 1)
        segment = shm.applies(x, group)
    finally:
        shm._host_id = default  # type: ignore[assignment]
    return segment is None, all_reduce(x, group), reduce_scatter(x, group)


def test_a_group_across_hosts_keeps_gloo(worker_pools: PoolFactory) -> None:
    for rank, (kept_gloo, reduced, scattered) in enumerate(worker_pools(2).run(_other_host)):
        assert kept_gloo, f"rank {rank} mapped a segment for a group that spans hosts"
        assert torch.equal(reduced, torch.arange(6.0) * 3)
        assert torch.equal(scattered, (torch.arange(6.0) * 3).chunk(2)[rank])


def _leftovers(rank: int) -> tuple[bool, list[str]]:
    """Whether the group maps a segment, and the segment files this job's processes left: a
    collective's are named by the pid of the rank that made them, a p2p pair's by the job's
    token in the store (other Tessera jobs on the host, a test run beside this one, are not ours)."""
    group = dist.new_group([0, 1])
    on = shm.applies(torch.ones(1), group) is not None
    all_reduce(torch.ones(1), group)
    pids: list[object] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    store = dist.distributed_c10d._get_default_store()
    key = "tessera/shm/job"
    jobs = [store.get(key).decode()] if store.check([key]) else []
    ours = tuple(f"tessera-{x}-" for x in [*pids, *jobs])
    return on, sorted(p.name for p in Path("/dev/shm").glob("tessera-*") if p.name.startswith(ours))


def test_segments_leave_no_file_behind(worker_pools: PoolFactory) -> None:
    for on, files in worker_pools(2).run(_leftovers):
        assert on and files == []


def test_off_keeps_gloo(worker_pools: PoolFactory) -> None:
    got = worker_pools(2).run(_leftovers, env={ENV: "0"})
    assert [on for on, _ in got] == [False, False]


def _sends_to_a_deaf_peer(rank: int) -> list[str]:
    """Rank 0 sends on a tag rank 1 never uses: only rank 0 maps that pair's file."""
    share_memory(None)
    before = set(Path("/dev/shm").glob("tessera-*"))
    if rank == 0:
        shm_p2p.isend(torch.ones(4), 1, None, tag=7)
    return sorted(str(p) for p in set(Path("/dev/shm").glob("tessera-*")) - before)


def test_a_pair_file_its_peer_never_mapped_goes_at_exit() -> None:
    """Real processes: the file stays while rank 0 lives (rank 1 might still map it) and is
    gone once rank 0 exits."""
    with WorkerPool(2, timeout=120.0) as pool:
        made = pool.run(_sends_to_a_deaf_peer)[0]
        assert len(made) == 1 and Path(made[0]).exists(), made
    assert not Path(made[0]).exists(), f"{made[0]} left behind"


def _dies(rank: int, report: str) -> None:
    all_reduce(torch.ones(4))  # both ranks set the segment up
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        all_reduce(torch.ones(4))
        outcome = "returned"
    except shm.SegmentError as exc:
        outcome = f"{exc} after {time.monotonic() - start:.1f} s"
    Path(report).write_text(outcome)


def test_a_dead_peer_fails_the_waiting_rank_by_name(tmp_path: Path) -> None:
    """Real processes: rank 1 exits while rank 0 waits for it in an all-reduce. The pool's
    process-group timeout is 300 s; the segment notices the death at its next check (50 ms)."""
    report = tmp_path / "rank0.txt"
    with WorkerPool(2, timeout=120.0) as pool, pytest.raises(RankFailure):
        pool.run(_dies, str(report))
    deadline = time.monotonic() + 60.0  # rank 0 writes its report after the pool saw rank 1 die
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = report.read_text() if report.exists() else "no report"
    assert "group rank 1" in outcome and "died during all_reduce" in outcome, outcome
