"""Running the workers: torch.distributed.run in this process, attempt after attempt.

``spawn`` launches every rank of this node through torch.distributed.run with the watchdog
watching them (and, on several nodes, the node watch watching the other nodes,
``liveness.NodeWatch``). When a rank fails, hangs (the watchdog; on several nodes the node watch
then settles whether a lost node was the cause, and names it) or a node is lost, it
launches again, up to ``train.max_restarts`` times, from the newest committed checkpoint
generation (the job's own resume logic). Each attempt is a fresh rendezvous, with its own id
(``<rdzv_id>-<attempt>``), so nodes that restart meet again instead of waiting on a closed
one. With ``--nnodes MIN:MAX`` an attempt starts on as many nodes as come, at least MIN, and
the workers set dp from the world they find (``elastic``). Any node may be the one lost: when
it is the rendezvous host (node 0 at first), the lowest node left hosts the rendezvous and the
node watch from the next attempt on, at its own address (``rehost``). SIGINT, SIGTERM or SIGUSR1:
the ranks of the main job save and stop, and this says where (``stopping``); no restart follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tessera.launcher.config import Config
from tessera.launcher.config.config_io import (
    HEARTBEAT_ENV,
    LAUNCHER_PID_ENV,
    RESOLVED_ENV,
    RESTART_ENV,
    config_to_dict,
)
from tessera.launcher.config.elastic import ELASTIC_ENV
from tessera.launcher.run.liveness import NodeWatch, watch_port
from tessera.launcher.run.nodes import NodePlan, endpoint_host, endpoint_port
from tessera.launcher.run.rehost import Lease, next_host
from tessera.launcher.run.stopping import AGENT_SIGNALS, exit_code, read_note, stop_line
from tessera.launcher.run.watchdog import Watchdog, read_beats

__all__ = ["build_torchrun_argv", "spawn"]

RESTART_LAST_CALL_S = 10  # how long a restarted rendezvous waits for more than MIN nodes


def build_torchrun_argv(
    plan: NodePlan, *, log_dir: str, target: Sequence[str], attempt: int = 0, read_timeout: int = 60
) -> list[str]:
    """Arguments for torch.distributed.run: no restarts of its own (``spawn`` restarts a failed
    job itself), per-rank logs, rank 0 on the console; on several nodes the rendezvous of this
    ``attempt``, whose store calls give up after ``read_timeout`` seconds (torch's default, 60,
    would keep a node waiting that long on every call to a host that vanished)."""
    argv = [f"--nproc-per-node={plan.nproc_per_node}", "--max-restarts=0", "--monitor-interval=0.2"]
    argv += [f"--signals-to-handle={AGENT_SIGNALS}"]  # passed on to the ranks (SIGUSR1 too: `stopping`)
    if plan.source == "local":
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={plan.rdzv_endpoint}",
            "--nnodes=1",
            "--local-addr=127.0.0.1",
        ]
    else:
        # the host node (node 0, or the survivor that took over) hosts the store (``netif``):
        # torch would match the endpoint to the hostname
        conf = [f"is_host={int(plan.node_rank == plan.host_node)}"]
        if plan.elastic and attempt > 0:
            conf.append(f"last_call_timeout={RESTART_LAST_CALL_S}")
        if read_timeout != 60:
            conf.append(f"read_timeout={read_timeout}")
        nnodes = f"{plan.min_nodes}:{plan.nnodes}" if plan.elastic else str(plan.nnodes)
        argv += [
            f"--nnodes={nnodes}",
            f"--node-rank={plan.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={plan.rdzv_endpoint}",
            f"--rdzv-id={plan.rdzv_id}-{attempt}",
            f"--rdzv-conf={','.join(conf)}",
        ]
        argv += [f"--local-addr={plan.local_addr}"] if plan.local_addr else []
    argv += [f"--log-dir={log_dir}", "--tee=3", "--local-ranks-filter=0"]
    return [*argv, "-m", "tessera.launcher.run.worker", *target]


@contextlib.contextmanager
def _rendezvous_store(plan: NodePlan) -> Iterator[None]:
    """Node 0: the rendezvous store for the whole run, not one per attempt. Every attempt's
    agent reuses it (torch's stores are multi-tenant), so the other nodes' agents never see it
    vanish when node 0 ends an attempt, and meet again there under the next attempt's id."""
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore(
        endpoint_host(plan.rdzv_endpoint),
        endpoint_port(plan.rdzv_endpoint),
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
    )
    try:
        yield
    finally:
        del store


def _kill_workers(heartbeats: Path) -> None:
    for beat in read_beats(heartbeats):
        with contextlib.suppress(OSError):
            os.kill(beat.pid, signal.SIGKILL)


def spawn(
    plan: NodePlan,
    config: Config,
    *,
    target: list[str],
    log_dir: str,
    loopback_port: int | None,
    say: Callable[[str], None],
    run: Path | None = None,
) -> int:
    """Every attempt of the job on this node (module docstring); the exit code. ``run``: the
    main job's run folder (where a stopped job's checkpoint is)."""
    with tempfile.TemporaryDirectory(prefix="tessera-run-") as tmp:
        resolved = Path(tmp, "config.json")
        resolved.write_text(json.dumps(config_to_dict(config)))
        heartbeats = Path(tmp, "heartbeats")
        heartbeats.mkdir()
        os.environ[RESOLVED_ENV] = str(resolved)
        os.environ[HEARTBEAT_ENV] = str(heartbeats)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers die with this process
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if plan.elastic:
            os.environ[ELASTIC_ENV] = "1"
        os.makedirs(log_dir, exist_ok=True)
        with contextlib.ExitStack() as stack:
            if plan.nnodes > 1 and plan.node_rank == plan.host_node:
                stack.enter_context(_rendezvous_store(plan))
                if run is not None:
                    stack.enter_context(Lease(run, plan.node_rank))
            watch = None
            if plan.nnodes > 1 and config.train.watchdog_s > 0:
                host = endpoint_host(plan.rdzv_endpoint)
                watch = NodeWatch(
                    host=host,
                    port=watch_port(endpoint_port(plan.rdzv_endpoint)),
                    node_rank=plan.node_rank,
                    nnodes=plan.nnodes,
                    timeout_s=config.train.watchdog_s,
                    heartbeats=heartbeats,
                    report=say,
                    on_lost=lambda: _kill_workers(heartbeats),
                    address=plan.local_addr,
                )
                stack.enter_context(watch)
            for attempt in range(config.train.max_restarts + 1):
                os.environ[RESTART_ENV] = str(attempt)
                if watch is not None:
                    watch.begin(attempt)
                code, again = _attempt(
                    plan, config, target, log_dir, loopback_port, heartbeats, attempt, say, watch, run
                )
                if not again or attempt == config.train.max_restarts:
                    return code
                if watch is not None:  # the next attempt's rendezvous host (`rehost`)
                    moved = next_host(plan, watch, say, run, config.train.watchdog_s)
                    if moved is None:
                        return code
                    if moved.host_node != plan.host_node:
                        if moved.node_rank == moved.host_node:
                            stack.enter_context(_rendezvous_store(moved))
                            if run is not None:
                                stack.enter_context(Lease(run, moved.node_rank))
                        watch.move(moved.host_node, endpoint_host(moved.rdzv_endpoint))
                    plan = moved
                fewer = f" on the nodes that remain (at least {plan.min_nodes})" if plan.elastic else ""
                say(
                    f"restart {attempt + 1} of {config.train.max_restarts}{fewer}: every rank, from the "
                    "newest committed checkpoint generation"
                )
    return 1


def _attempt(
    plan: NodePlan,
    config: Config,
    target: list[str],
    log_dir: str,
    loopback_port: int | None,
    heartbeats: Path,
    attempt: int,
    say: Callable[[str], None],
    watch: NodeWatch | None,
    run: Path | None,
) -> tuple[int, bool]:
    """One launch of every rank: (exit code, whether a restart may help: a rank failed, hung or
    a node was lost; not after a stop on a signal).

    Each attempt is a fresh torch.distributed.run (its own rendezvous and stores): torch's own
    ``--max-restarts`` hung here on this torch version (the restarted workers never met)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousGracefulExitError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from tessera.launcher.run.loopback import loopback_rendezvous

    for beat in heartbeats.glob("*"):
        beat.unlink()
    watchdog = Watchdog(heartbeats, config.train.watchdog_s, say)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(watchdog)
            if loopback_port is not None:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback too
                endpoint = stack.enter_context(loopback_rendezvous(loopback_port))
                plan = dataclasses.replace(plan, rdzv_endpoint=endpoint)
            read_timeout = max(10, int(config.train.watchdog_s)) if config.train.watchdog_s > 0 else 60
            argv = build_torchrun_argv(
                plan, log_dir=log_dir, target=target, attempt=attempt, read_timeout=min(60, read_timeout)
            )
            torchrun(get_args_parser().parse_args(argv))  # type: ignore[no-untyped-call]  # torch: run() unannotated
    except ChildFailedError as exc:
        if watchdog.fired and watch is not None:
            watch.settle()  # a rank that waited on a lost node: name the node as the cause
        if not watchdog.fired and not (watch is not None and watch.lost):
            print(exc.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]  # torch: format_msg unannotated
        return 1, True
    except RendezvousGracefulExitError:
        return 0, False
    except RendezvousError as exc:  # the store went away: node 0 ended its attempt (a lost node)
        _kill_workers(heartbeats)
        say(f"this attempt's rendezvous failed ({type(exc).__name__}: {exc})")
        return 1, True
    except (KeyboardInterrupt, SignalException) as exc:  # torch's agent gave the ranks the signal
        signum = int(exc.sigval) if isinstance(exc, SignalException) else int(signal.SIGINT)
        say(stop_line(signum, read_note(heartbeats), run))
        return exit_code(signum), False
    if watchdog.fired:
        if watch is not None:
            watch.settle()
        return 1, True
    if watch is not None:
        watch.finish()
    note = read_note(heartbeats)
    if note is not None:  # the ranks were signalled, not this process: they saved and stopped
        signum = int(signal.Signals[note.signal])
        say(stop_line(signum, note, run))
        return exit_code(signum), False
    return 0, False
