"""Tier 0: node layout from flags, hostfiles, SLURM and OpenMPI environments."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.launcher.run.nodes import NodePlan, expand_slurm_nodelist, plan_nodes, read_hostfile


def test_slurm_nodelists() -> None:
    assert expand_slurm_nodelist("gpu5") == ["gpu5"]
    assert expand_slurm_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_slurm_nodelist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]


def test_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# cluster\nworker-1 slots=8\nworker-2\n\n")
    assert read_hostfile(path) == [("worker-1", 8), ("worker-2", None)]
    plan = plan_nodes(
        nproc_per_node=8, nnodes=None, node_rank=1, rdzv_endpoint=None, hostfile=str(path), env={}
    )
    assert (plan.nnodes, plan.node_rank, plan.rdzv_endpoint, plan.world_size) == (2, 1, "worker-1:29500", 16)
    path.write_text("worker-1 cores=8\n")
    with pytest.raises(ValueError, match="expected 'host \\[slots=N\\]'"):
        read_hostfile(path)


def test_local_slurm_and_openmpi() -> None:
    local = plan_nodes(
        nproc_per_node=4, nnodes=None, node_rank=None, rdzv_endpoint=None, hostfile=None, env={}
    )
    assert (local.source, local.nnodes, local.rdzv_endpoint) == ("local", 1, "127.0.0.1:0")
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NODEID": "2"}
    slurm = plan_nodes(
        nproc_per_node=2, nnodes=None, node_rank=None, rdzv_endpoint=None, hostfile=None, env=env
    )
    assert (slurm.source, slurm.nnodes, slurm.node_rank, slurm.rdzv_endpoint, slurm.rdzv_id) == (
        "slurm",
        4,
        2,
        "n1:29500",
        "42",
    )
    # --nnodes alone (an elastic MIN:MAX) keeps SLURM's hosts and node rank
    elastic = plan_nodes(
        nproc_per_node=2, nnodes=4, node_rank=None, rdzv_endpoint=None, hostfile=None, env=env, min_nodes=2
    )
    assert (elastic.source, elastic.node_rank, elastic.rdzv_endpoint) == ("slurm", 2, "n1:29500")
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    plan = plan_nodes(
        nproc_per_node=2, nnodes=None, node_rank=None, rdzv_endpoint="h:1", hostfile=None, env=mpi
    )
    assert (plan.source, plan.nnodes, plan.node_rank) == ("openmpi", 2, 1)
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        plan_nodes(nproc_per_node=2, nnodes=None, node_rank=None, rdzv_endpoint=None, hostfile=None, env=mpi)


def test_flag_mistakes() -> None:
    with pytest.raises(ValueError, match="--nnodes 3 needs --rdzv-endpoint"):
        plan_nodes(nproc_per_node=1, nnodes=3, node_rank=0, rdzv_endpoint=None, hostfile=None, env={})
    with pytest.raises(ValueError, match="node rank 3 is outside \\[0, 2\\)"):
        plan_nodes(nproc_per_node=1, nnodes=2, node_rank=3, rdzv_endpoint="h:1", hostfile=None, env={})
    with pytest.raises(ValueError, match="--nproc-per-node must be >= 1, got 0"):
        plan_nodes(nproc_per_node=0, nnodes=None, node_rank=None, rdzv_endpoint=None, hostfile=None, env={})


def test_a_hostfile_gives_the_processes_per_node_and_this_node_s_rank(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("10.1.0.1 slots=2\n10.1.0.2 slots=2\n10.1.0.3 slots=2\n")

    def plan(**kw: object) -> NodePlan:
        base: dict[str, object] = dict(
            nproc_per_node=None, nnodes=None, node_rank=None, rdzv_endpoint=None, hostfile=str(path), env={}
        )
        return plan_nodes(**{**base, **kw})  # type: ignore[arg-type]

    mine = plan(is_me=lambda h: h == "10.1.0.2", world_size=99)
    assert (mine.nproc_per_node, mine.node_rank, mine.world_size, mine.rdzv_endpoint) == (
        2, 1, 6, "10.1.0.1:29500"
    )  # fmt: skip
    assert plan(is_me=lambda h: False, node_rank=2, nproc_per_node=4).nproc_per_node == 4
    with pytest.raises(ValueError, match=r"none of 10\.1\.0\.1, 10\.1\.0\.2, 10\.1\.0\.3; pass --node-rank"):
        plan(is_me=lambda h: False)
    path.write_text("a slots=2\nb slots=4\n")
    with pytest.raises(ValueError, match=r"every host needs the same slots=, got \[2, 4\]"):
        plan(node_rank=0)
    path.write_text("a\nb\n")
    assert plan(node_rank=1, world_size=8).nproc_per_node == 4
