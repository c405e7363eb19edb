"""The ``tessera`` command: ``run`` (a thin layer over torch.distributed.run), ``config``, ``train``,
``finetune`` (LoRA on a pretrained Hugging Face model: ``tessera.launcher.job.finetune_job``),
``prepare-data`` (the main job's ``data.path`` into token shards: ``tessera.launcher.data.prepare``),
``plan`` (predict and rank every configuration: ``tessera.launcher.run.plan_command`` over
``tessera.planner``).

Exit codes: 0 success, 1 a rank failed or hung (the watchdog), 2 a configuration or usage
mistake (found before anything spawns, and before torch is imported), 130 stopped by SIGINT
(Ctrl-C), 143 by SIGTERM and 138 by SIGUSR1 (the main job saves a checkpoint first: ``stopping``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from tessera.comm import Axis
from tessera.launcher.config import Config
from tessera.launcher.config.auto import auto_launch
from tessera.launcher.config.config_io import (
    RUN_FOLDER_ENV,
    ConfigError,
    config_to_toml,
    resolve_config,
)
from tessera.launcher.config.elastic import elastic_problems
from tessera.launcher.config.finetune_config import finetune_problems
from tessera.launcher.config.world import fit_world, known_world_size
from tessera.launcher.config.world_rule import world_needed
from tessera.launcher.data.prepare import ensure_prepared, prepare_command
from tessera.launcher.run import netif
from tessera.launcher.run.fanout import start_every_node
from tessera.launcher.run.nodes import (
    NodePlan,
    endpoint_host,
    endpoint_port,
    is_loopback,
    parse_nnodes,
    plan_nodes,
    slurm_restarts,
)
from tessera.launcher.run.plan_command import add_arguments as add_plan_arguments
from tessera.launcher.run.plan_command import run as run_plan
from tessera.launcher.run.preflight import preflight
from tessera.launcher.run.runs import RunFolderError, create_run_folder, requeued
from tessera.launcher.run.spawn import build_torchrun_argv, spawn
from tessera.launcher.run.stopping import exit_code

__all__ = ["build_torchrun_argv", "main", "rank_table"]

MAIN_JOB = "tessera.launcher.job.main_job"
FINETUNE_JOB = "tessera.launcher.job.finetune_job"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field, e.g. --set parallel.tp=2 (repeatable; wins over file and environment)",
    )


def _add_verify_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare the first step with a serial step of the same model; refuse to train on a "
        "mismatch (= --set train.verify=true; boost() reads it)",
    )


def _add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc-per-node",
        type=int,
        help="processes per node (default: the hostfile's slots=, else the config's world size / nodes)",
    )
    p.add_argument(
        "--nnodes", help="number of nodes, or MIN:MAX: the job may restart on as few as MIN (elastic)"
    )
    p.add_argument(
        "--node-rank", type=int, help="this node's rank (default: from a hostfile, SLURM or OpenMPI, else 0)"
    )
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (default: 127.0.0.1, any free port)")
    p.add_argument("--hostfile", help="file listing the nodes, one 'host [slots=N]' per line")
    p.add_argument(
        "--ssh",
        action="store_true",
        help="start this command on every host of --hostfile over ssh, each with its --node-rank",
    )
    p.add_argument(
        "--ssh-command", default="ssh", help="what --ssh runs instead of plain ssh (e.g. 'ssh -p 2222')"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Train PyTorch models across processes.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a script on every rank (over torch.distributed.run)")
    _add_node_args(run)
    run.add_argument("--log-dir", default=None, help="per-rank log files (default: runs/logs)")
    run.add_argument(
        "--dry-run", action="store_true", help="print the per-node commands and the rank table, then exit"
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        help="restart every rank after a failure, this many times (= --set train.max_restarts=N)",
    )
    run.add_argument("-m", dest="module", help="run a module instead of a script")
    _add_config_args(run)
    _add_verify_arg(run)
    run.add_argument("script", nargs="?", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    cfg = sub.add_parser("config", help="show the resolved configuration")
    cfg.add_argument("--print", action="store_true", dest="show", help="print it as TOML (the default)")
    _add_config_args(cfg)

    train = sub.add_parser("train", help="the main job: a character-level GPT on the Python standard library")
    _add_config_args(train)
    _add_verify_arg(train)
    _add_node_args(train)
    train.add_argument(
        "--dry-run", action="store_true", help="print the commands and the rank table, then exit"
    )
    tune = sub.add_parser(
        "finetune", help="LoRA fine-tuning of a pretrained Hugging Face model on a jsonl file ([finetune])"
    )
    _add_config_args(tune)
    _add_node_args(tune)
    tune.add_argument(
        "--dry-run", action="store_true", help="print the commands and the rank table, then exit"
    )
    prep = sub.add_parser("prepare-data", help="tokenize the main job's data.path once into token shards")
    _add_config_args(prep)
    plan = sub.add_parser("plan", help="predict memory and step time of every configuration; pick the best")
    _add_config_args(plan)
    add_plan_arguments(plan)
    return parser


def rank_table(config: Config, plan: NodePlan) -> str:
    """One line per rank: node, local rank and (pp, dp, cp, tp) coordinates."""
    topo = config.parallel.topology()
    grid = [a for a in topo.axes if a not in (Axis.PP, Axis.DP, Axis.CP, Axis.TP)]  # tp sub-axes
    lines = ["rank  node  local  pp  dp  cp  tp" + "".join(f"  {a.value}" for a in grid)]
    for rank in range(topo.world_size):
        c = topo.coordinates(rank)
        node, local = divmod(rank, plan.nproc_per_node)
        lines.append(
            f"{rank:>4}  {node:>4}  {local:>5}  "
            f"{c[Axis.PP]:>2}  {c[Axis.DP]:>2}  {c[Axis.CP]:>2}  {c[Axis.TP]:>2}"
            + "".join(f"  {c[a]:>{len(a.value)}}" for a in grid)
        )
    return "\n".join(lines)


def _say(line: str) -> None:
    print(f"tessera: {line}", file=sys.stderr, flush=True)


def _fail(lines: Sequence[str]) -> int:
    for line in lines:
        _say(line)
    return 2


def _run(
    args: argparse.Namespace,
    target: list[str],
    config: Config,
    *,
    main_job: bool = False,
    folder: bool = False,
) -> int:
    """Launch ``target`` with ``config``. ``main_job``: the main job's checks and data; ``folder``
    (the main job and ``tessera finetune``): the launcher makes the run folder, and a SLURM
    requeue goes on in it (`requeued`)."""
    folder = folder or main_job
    if args.ssh:
        return _fan_out(args, config)
    min_nodes = None
    if args.nnodes is not None:
        try:
            min_nodes, args.nnodes = parse_nnodes(args.nnodes)
        except ValueError as exc:
            return _fail([str(exc)])
    nnodes_hint = args.nnodes or 1
    if config.parallel.auto:  # the planner's choice for the world about to start
        try:
            config, chosen, per_node = auto_launch(config, args.nproc_per_node, nnodes_hint)
        except ValueError as exc:
            return _fail([str(exc)])
        _say(f"parallel.auto: {chosen.label()} (predicted {chosen.step_time:.3g} s/step)")
        args.nproc_per_node = per_node
    if known_world_size(config) is None and args.nproc_per_node is None and args.hostfile is None:
        return _fail([world_needed(config.parallel.degree_values())])
    try:
        plan = plan_nodes(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            hostfile=args.hostfile,
            env=os.environ,
            world_size=known_world_size(config),
            is_me=netif.owns_address,
            min_nodes=min_nodes if min_nodes != args.nnodes else None,
        )
    except ValueError as exc:
        return _fail([str(exc)])
    try:  # a degree of -1, or dp when none is set, from the world about to start
        config = fit_world(config, plan.world_size)
    except ValueError as exc:
        return _fail([f"--nproc-per-node {plan.nproc_per_node} x {plan.nnodes} node(s): {exc}"])
    again = folder and plan.source == "slurm" and slurm_restarts(os.environ) > 0
    if again:  # SLURM started the job again (a requeue): it goes on in its run folder (`requeued`)
        config = requeued(config)
        start = f"resuming from {config.train.resume}" if config.train.resume else "starting from step 0"
        _say(f"SLURM restart {slurm_restarts(os.environ)} of job {plan.rdzv_id}: {start}")
    fitted = config.validate() if main_job else config.validate_fields()
    if fitted:
        return _fail(fitted)
    if plan.elastic:  # every smaller world the job may restart on must work too
        worlds = [n * plan.nproc_per_node for n in plan.node_counts]
        lines = elastic_problems(config, worlds, main_job=main_job)
        if lines:
            return _fail([f"--nnodes {plan.min_nodes}:{plan.nnodes}: {line}" for line in lines])
    errors = preflight(config, main_job=main_job, processes=plan.nproc_per_node, nodes=plan.nnodes)
    if main_job and not args.dry_run and not errors:
        errors = ensure_prepared(config, _say)  # data.path's text tokenized once, before spawning
    if not args.dry_run and not errors:
        plan, errors = _place_node(plan)
    if errors:
        return _fail(errors)
    log_dir = args.log_dir or os.path.join(config.train.run_dir, "logs")
    if args.dry_run:
        for node in range(plan.nnodes):
            node_plan = dataclasses.replace(plan, node_rank=node)
            cmd = [
                "python",
                "-m",
                "torch.distributed.run",
                *build_torchrun_argv(node_plan, log_dir=log_dir, target=target),
            ]
            print(f"# node {node} ({plan.hosts[node]})\n{shlex.join(cmd)}")
        print(rank_table(config, plan))
        return 0
    made = None
    if folder:
        try:
            made = create_run_folder(config, joining=plan.node_rank > 0, again=again)
        except RunFolderError as exc:
            return _fail([str(exc)])
        os.environ[RUN_FOLDER_ENV] = str(made)
        log_dir = args.log_dir or str(made / "logs")
    loopback = plan.source == "local" and (args.rdzv_endpoint is None or is_loopback(args.rdzv_endpoint))
    return spawn(
        plan,
        config,
        target=target,
        log_dir=log_dir,
        loopback_port=endpoint_port(plan.rdzv_endpoint) if loopback else None,
        say=_say,
        run=made,
    )


def _fan_out(args: argparse.Namespace, config: Config) -> int:
    """``--ssh``: the hostfile checked here, then this command on every host (``fanout``)."""
    if args.hostfile is None:
        return _fail(["--ssh starts the hosts of a hostfile: give --hostfile"])
    if args.node_rank is not None:
        return _fail(["--ssh gives each host its own --node-rank: leave --node-rank out"])
    try:
        min_nodes, nnodes = parse_nnodes(args.nnodes) if args.nnodes is not None else (None, None)
        plan = plan_nodes(
            nproc_per_node=args.nproc_per_node, nnodes=nnodes, node_rank=0, rdzv_endpoint=args.rdzv_endpoint,
            hostfile=args.hostfile, env=os.environ, world_size=known_world_size(config),
            min_nodes=min_nodes if min_nodes != nnodes else None,
        )  # fmt: skip
    except ValueError as exc:
        return _fail([str(exc)])
    return start_every_node(plan.hosts, args.raw, args.ssh_command, _say)


def _place_node(plan: NodePlan) -> tuple[NodePlan, list[str]]:
    """Several nodes: node 0 hosts the rendezvous, so it must own the endpoint's address; each
    node advertises its address on the route to the endpoint (torch would take the hostname's),
    and gloo uses that interface unless GLOO_SOCKET_IFNAME is set."""
    if plan.source == "local":
        return plan, []
    host = endpoint_host(plan.rdzv_endpoint)
    if netif.resolve(host) is None:
        return plan, [f"--rdzv-endpoint {plan.rdzv_endpoint}: {host!r} does not resolve to an address"]
    if plan.node_rank == 0 and not netif.owns_address(host):
        return plan, [
            f"--rdzv-endpoint {plan.rdzv_endpoint} is not an address of this machine, but node rank 0 "
            "hosts the rendezvous: give node 0's own address or name"
        ]
    source = netif.route_source(host)
    name = None if source is None else netif.interface_of(source)
    if name is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        _say(f"node {plan.node_rank}: gloo uses {name} ({source}), the interface that reaches {host}")
    return dataclasses.replace(plan, local_addr=source), []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` command."""
    try:
        return _command(argv)
    except KeyboardInterrupt:  # before any rank started (while spawning, ``spawn`` says it)
        _say("interrupted by SIGINT before the job started")
        return exit_code(signal.SIGINT)


def _command(argv: Sequence[str] | None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(raw)
    args.raw = raw
    if getattr(args, "max_restarts", None) is not None:
        args.sets.append(f"train.max_restarts={args.max_restarts}")
    if getattr(args, "verify", False):
        args.sets.append("train.verify=true")
    try:
        # a script of one's own brings its own model: `tessera run` checks the core sections only
        # (the script's boost() checks its model); the other commands are the main job's
        config = resolve_config(args.config, args.sets, main_job=args.command not in ("run", "finetune"))
    except ConfigError as exc:
        return _fail(exc.lines)
    if args.command == "config":
        print(config_to_toml(config), end="")
        return 0
    if args.command == "plan":
        return run_plan(args, config)
    if args.command == "prepare-data":
        return prepare_command(config, _say)
    if args.command == "train":
        args.log_dir = None
        return _run(args, ["-m", MAIN_JOB], config, main_job=True)
    if args.command == "finetune":  # its model is the pretrained one: boost() checks it, like a script's
        problems = finetune_problems(config.finetune)
        if config.train.verify:
            problems.append(
                "train.verify: tessera finetune builds its model without values (the pretrained weights "
                "stream in after boost), so there is no serial step to compare; verify the layout with "
                "boost(..., verify=True) on a model that fits one process"
            )
        if problems:
            return _fail(problems)
        args.log_dir = None
        return _run(args, ["-m", FINETUNE_JOB], config, folder=True)
    if (args.module is None) == (args.script is None):
        return _fail(["tessera run needs exactly one of: a script path, or -m MODULE"])
    target = (
        ["-m", args.module, *([args.script] if args.script else []), *args.args]
        if args.module
        else [args.script, *args.args]
    )
    if args.script and not args.module and not args.dry_run and not Path(args.script).is_file():
        return _fail([f"script {args.script!r} does not exist"])
    return _run(args, target, config)


if __name__ == "__main__":
    raise SystemExit(main())
