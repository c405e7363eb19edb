"""``tessera plan``: search every configuration for the model of ``--config`` on a cluster
(`tessera.planner`, through `tessera.launcher.config.auto`), print the best, write the winner and a
chart; ``--calibrate`` measures this machine instead.

Without ``--calibrate`` nothing here imports torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tessera.launcher.config import Config
from tessera.launcher.config.auto import config_of, experts_of, model_of, search_config
from tessera.launcher.config.config_io import config_to_toml
from tessera.planner import Candidate
from tessera.planner.calibrate import calibrate  # imports torch only when it runs
from tessera.planner.cluster import PRESETS, calibrated_path, cluster_to_toml, resolve_cluster
from tessera.planner.report import summary, table, write_png

__all__ = ["add_arguments", "run", "write_winner"]


def write_winner(base: Config, candidate: Candidate, path: str | Path) -> None:
    """Write the winner's configuration (``base`` run as its layout) as TOML that ``tessera
    run --config`` accepts."""
    header = f"# written by `tessera plan`: {candidate.label()}, predicted {candidate.step_time:.4g} s/step\n"
    Path(path).write_text(header + config_to_toml(config_of(base, candidate.layout)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``tessera plan`` (``--config``/``--set`` are added by the caller)."""
    p.add_argument(
        "--cluster",
        default="",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a TOML file with a [cluster] table (default: "
        f"parallel.cluster, else the file --calibrate wrote at {calibrated_path()} if any, else cpu)",
    )
    p.add_argument(
        "--world", type=int, help="plan for this many devices (default: every device of the cluster)"
    )
    p.add_argument("--top", type=int, default=10, help="how many candidates to show (default 10)")
    p.add_argument("--out", metavar="FILE", help="write the winner as a config `tessera run` accepts")
    p.add_argument("--png", metavar="FILE", help="write a chart of predicted memory against step time")
    p.add_argument(
        "--tp-modes", default="1d,2d,2.5d,3d", help="tensor-parallel modes to consider (default: all)"
    )
    p.add_argument(
        "--calibrate",
        nargs="?",
        const="",
        metavar="FILE",
        help=f"time matmuls and gloo collectives here and write a cluster TOML (default {calibrated_path()}, "
        "where parallel.auto and tessera plan look for it)",
    )


def run(args: argparse.Namespace, config: Config) -> int:
    """Run ``tessera plan``; exit code 0, or 2 for a mistake (said on stderr)."""
    if args.calibrate is not None:
        cluster = calibrate()
        out = Path(args.calibrate) if args.calibrate else calibrated_path()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(cluster_to_toml(cluster))
        print(cluster_to_toml(cluster), end="")
        print(f"tessera: wrote {out}", file=sys.stderr)
        return 0
    try:
        cluster = resolve_cluster(args.cluster or config.parallel.cluster)
    except (ValueError, OSError) as exc:
        print(f"tessera: {exc}", file=sys.stderr)
        return 2
    world = args.world or cluster.world_size
    if world < 1 or args.top < 1:
        print(f"tessera: --world ({world}) and --top ({args.top}) must be >= 1", file=sys.stderr)
        return 2
    modes = tuple(m.strip() for m in args.tp_modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in ("1d", "2d", "2.5d", "3d")]
    if unknown:
        print(f"tessera: --tp-modes {unknown} not among 1d, 2d, 2.5d, 3d", file=sys.stderr)
        return 2
    model = model_of(config)
    keep = max(args.top, 10)
    both = (False, True)  # with and without activation checkpointing
    result = search_config(config, cluster, world=world, tp_modes=modes, recompute=both, keep=keep)
    print(summary(result, model, cluster, world, experts_of(config)))
    if not result.ranked:
        if result.too_big or result.overflow:
            smallest = min((c.estimate.memory.device for c in result.too_big), default=None)
            need = "" if smallest is None else f" (the smallest evaluated needs {smallest / 2**30:.3g} GiB)"
            reason = f"fits {world} devices of {cluster.memory_gib:g} GiB{need}"
        else:
            reason = (
                f"uses exactly {world} devices: the launcher refused all {result.invalid} candidates "
                "(degrees must divide the batch, heads and sequence; try another --world)"
            )
        print(f"tessera: no valid configuration {reason}", file=sys.stderr)
        return 2
    print(table(result.ranked[: args.top], model, world))
    best = result.ranked[0]
    if args.out:
        write_winner(config, best, args.out)
        print(f"tessera: wrote the winner ({best.label()}) to {args.out}", file=sys.stderr)
    if args.png:
        write_png(result, cluster, args.png, top=args.top)
        print(f"tessera: wrote {args.png}", file=sys.stderr)
    return 0
