"""Tier 1: elastic node counts, the degrees at a smaller world, the per-attempt rendezvous, and
nodes watching each other (two watches in this process, over a store on loopback)."""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tessera.launcher import Config, ParallelConfig
from tessera.launcher.config.config_io import RESOLVED_ENV, config_to_dict, load_config
from tessera.launcher.config.elastic import ELASTIC_ENV, at_world, elastic_problems
from tessera.launcher.run.liveness import NodeWatch
from tessera.launcher.run.nodes import parse_nnodes, plan_nodes
from tessera.launcher.run.spawn import RESTART_LAST_CALL_S, build_torchrun_argv
from tessera.launcher.run.watchdog import Beat, write_beat


def test_nnodes_takes_a_count_or_a_range() -> None:
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:3") == (1, 3)
    for bad, words in [
        ("0", "got 0"),
        ("3:2", "got MIN 3 and MAX 2"),
        ("a:2", "N or MIN:MAX"),
        ("0:2", "MIN 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_nnodes(bad)


def test_an_elastic_plan_and_its_rendezvous_per_attempt() -> None:
    plan = plan_nodes(
        nproc_per_node=2,
        nnodes=3,
        node_rank=1,
        rdzv_endpoint="10.0.0.1:29400",
        hostfile=None,
        env={},
        min_nodes=1,
    )
    assert plan.elastic and list(plan.node_counts) == [1, 2, 3] and plan.world_size == 6
    first = build_torchrun_argv(plan, log_dir="logs", target=["job.py"])
    again = build_torchrun_argv(plan, log_dir="logs", target=["job.py"], attempt=2)
    assert "--nnodes=1:3" in first and "--rdzv-id=tessera-0" in first and "--rdzv-conf=is_host=0" in first
    assert "--rdzv-id=tessera-2" in again
    assert f"--rdzv-conf=is_host=0,last_call_timeout={RESTART_LAST_CALL_S}" in again
    fixed = plan_nodes(nproc_per_node=2, nnodes=2, node_rank=0, rdzv_endpoint="h:1", hostfile=None, env={})
    assert not fixed.elastic and "--nnodes=2" in build_torchrun_argv(fixed, log_dir="l", target=["j"])


def test_data_parallelism_takes_the_processes_a_smaller_world_has() -> None:
    config = Config(parallel=ParallelConfig(dp=4, tp=2))
    assert at_world(config, 4).parallel.dp == 2 and at_world(config, 4).parallel.tp == 2
    with pytest.raises(ValueError, match="3 processes do not split into replicas of tp \\* pp \\* cp = 2"):
        at_world(config, 3)
    lines = elastic_problems(config, [8, 4, 3], main_job=False)
    assert len(lines) == 1 and lines[0].startswith("at 3 processes:"), lines


def test_a_restarted_worker_reads_dp_from_its_world(tmp_path: Path) -> None:
    resolved = tmp_path / "config.json"
    resolved.write_text(json.dumps(config_to_dict(Config(parallel=ParallelConfig(dp=4)))))
    env = {RESOLVED_ENV: str(resolved), "WORLD_SIZE": "2"}
    assert load_config(env).parallel.dp == 4  # not elastic: as launched
    assert load_config({**env, ELASTIC_ENV: "1"}).parallel.dp == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _watch(node: int, port: int, beats: Path, said: list[str], killed: list[int]) -> NodeWatch:
    return NodeWatch(
        host="127.0.0.1",
        port=port,
        node_rank=node,
        nnodes=2,
        timeout_s=1.0,
        heartbeats=beats,
        report=said.append,
        on_lost=lambda: killed.append(node),
        interval=0.1,
    )


def _wait_for(said: list[str], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds  # a bound, not a measurement: the test fails past it
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_node_that_stops_beating_is_named_with_its_ranks(tmp_path: Path) -> None:
    port = _free_port()
    beats = [tmp_path / "b0", tmp_path / "b1"]
    for k, folder in enumerate(beats):
        folder.mkdir()
        for rank in (2 * k, 2 * k + 1):  # each node's workers, as their heartbeats say
            write_beat(folder, Beat(rank=rank, pid=1, time=time.time(), step=0, step_time=None, done=False))
    said0: list[str] = []
    said1: list[str] = []
    killed: list[int] = []
    with _watch(0, port, beats[0], said0, killed):
        one = _watch(1, port, beats[1], said1, killed).__enter__()
        time.sleep(1.5)  # both beat for longer than the timeout: nobody is missed
        assert said0 == [] and said1 == [] and killed == []
        one._stop.set()  # node 1 stops beating without saying it is done (lost)
        one._thread.join()
        _wait_for(said0)
    assert len(said0) == 1 and killed == [0], (said0, killed)
    assert said0[0].startswith(f"node 1 ({socket.gethostname()}, ranks 2-3) is lost: no heartbeat for"), said0


def test_a_node_that_finished_is_not_missed(tmp_path: Path) -> None:
    port = _free_port()
    said: list[str] = []
    killed: list[int] = []
    with _watch(0, port, tmp_path, said, killed):
        with _watch(1, port, tmp_path, said, killed) as one:
            time.sleep(0.5)
            one.finish()
        time.sleep(1.5)  # past the timeout: node 1 said it was done, so it is not lost
    assert said == [] and killed == [], said


def test_when_node_0_is_gone_the_others_name_it(tmp_path: Path) -> None:
    port = _free_port()
    said: list[str] = []
    killed: list[int] = []
    zero = _watch(0, port, tmp_path, [], killed).__enter__()
    with _watch(1, port, tmp_path, said, killed):
        time.sleep(0.5)
        zero.__exit__(None, None, None)
        zero._store = None  # the store's server lives as long as its object
        gc.collect()
        _wait_for(said)
    assert (
        said and said[0] == f"node 0 (127.0.0.1) is lost: its store at 127.0.0.1:{port} stopped answering"
    ), said
    assert killed == [1]


def test_settling_after_a_hang_waits_for_a_silent_node_and_names_it(tmp_path: Path) -> None:
    """The rank watchdog can fire before a lost node's heartbeat is ``timeout_s`` old (the ranks
    waited on it from their last step on): settling waits for the watch to name the node."""
    port = _free_port()
    said0: list[str] = []
    killed: list[int] = []
    with _watch(0, port, tmp_path, said0, killed) as zero:
        one = _watch(1, port, tmp_path, [], killed).__enter__()
        time.sleep(0.5)
        one._stop.set()  # node 1 goes silent just before this node's watchdog fires
        one._thread.join()
        assert said0 == []
        lines = zero.settle()
    assert len(lines) == 1 and lines == said0 and killed == [0], (lines, said0, killed)
    assert lines[0].startswith(f"node 1 ({socket.gethostname()}, ranks unknown) is lost"), lines


def test_settling_names_a_silent_node_itself_when_the_watch_is_late(tmp_path: Path) -> None:
    """On a loaded host the watch's thread can name a silent node later than settling's bound,
    or notice the node's last beat only after settling began (which read as "beaten since"):
    settling compares the node's count in the store with what it was when settling began, and
    names a node whose count never moved by its bound itself. The watch here never names."""
    port = _free_port()
    said0: list[str] = []
    killed: list[int] = []
    with _watch(0, port, tmp_path, said0, killed) as zero:
        beat = zero._beat
        zero._beat = lambda store, now: (beat(store, now), [])[1]  # type: ignore[method-assign]
        one = _watch(1, port, tmp_path, [], killed).__enter__()
        time.sleep(0.5)
        one._stop.set()  # node 1 goes silent just before this node's watchdog fires
        one._thread.join()
        lines = zero.settle()
    assert len(lines) == 1 and lines == said0 and killed == [0], (lines, said0, killed)
    assert lines[0].startswith(f"node 1 ({socket.gethostname()}, ranks unknown) is lost"), lines


def test_settling_after_a_hang_with_every_node_alive_names_nobody(tmp_path: Path) -> None:
    port = _free_port()
    said: list[str] = []
    killed: list[int] = []
    with _watch(0, port, tmp_path, said, killed) as zero, _watch(1, port, tmp_path, said, killed):
        time.sleep(0.5)
        assert zero.settle() == []  # node 1 beat since: the hang was this node's ranks' own
    assert said == [] and killed == [], said


def _gone(zero: NodeWatch) -> None:
    """Node 0's launcher exits: its watch stops and its store's server goes with the object."""
    zero.__exit__(None, None, None)
    zero._store = None
    gc.collect()


def test_node_0_finishing_first_keeps_its_store_until_the_others_finish(tmp_path: Path) -> None:
    """At the end of a run node 0 may finish first: it waits for node 1 to finish before its
    store goes, so node 1, still beating, does not name node 0 lost."""
    port = _free_port()
    said: list[str] = []
    killed: list[int] = []
    zero = _watch(0, port, tmp_path, said, killed).__enter__()
    with _watch(1, port, tmp_path, said, killed) as one:
        time.sleep(0.3)
        leaving = threading.Thread(target=lambda: (zero.finish(), _gone(zero)))
        leaving.start()
        time.sleep(0.5)  # node 1's workers still run, and it beats (under the 1 s timeout)
        assert said == [], said
        one.finish()
        leaving.join()
        time.sleep(0.3)  # node 1's watch stays up a little after node 0 left
    assert said == [] and killed == [], said


def test_a_node_that_finished_does_not_miss_node_0s_store(tmp_path: Path) -> None:
    port = _free_port()
    said: list[str] = []
    killed: list[int] = []
    zero = _watch(0, port, tmp_path, said, killed).__enter__()
    with _watch(1, port, tmp_path, said, killed) as one:
        time.sleep(0.3)
        one.finish()
        zero.finish()
        _gone(zero)
        time.sleep(0.5)  # node 1 has not stopped its watch yet: the store is gone, its work is not
    assert said == [] and killed == [], said
