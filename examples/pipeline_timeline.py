"""Compare pipeline schedules on paper: simulate each, print its bubble, draw its timeline.

    python examples/pipeline_timeline.py                    # 4 stages, 8 microbatches
    python examples/pipeline_timeline.py --ranks 2 --microbatches 4 --out timelines

Schedules are data (``tessera.pipeline``): each is a list of actions per rank, checked by one
validator and timed by one simulator, so no process is started here. Every PNG has one row
per rank; forward, backward and weight-gradient work are shaded apart, idle time is blank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tessera.pipeline import Costs, schedule_spec, simulate, validate
from tessera.pipeline.render import timeline_png

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", default="timelines", help="folder for the PNGs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.ranks} ranks, {args.microbatches} microbatches; per microbatch and rank: F = B = W = 1")
    print(f"{'schedule':18} {'step':>6} {'bubble':>7} {'peak activations':>17}")
    for name in SCHEDULES:
        spec = schedule_spec(name)
        schedule = spec.build(args.ranks, args.microbatches)
        validate(schedule)
        v = spec.chunks()  # model chunks per rank: each costs 1/v of a rank's share
        # backward = input gradient (b) + weight gradient (w), apart only in zero-bubble schedules
        result = simulate(schedule, Costs(f=1.0 / v, b=1.0 / v, w=1.0 / v))
        timeline_png(result, out / f"{name}.png")
        print(f"{name:18} {result.makespan:6.1f} {result.mean_bubble:7.1%} {max(result.peak_in_flight):17d}")
    print(f"timelines written to {out}/")


if __name__ == "__main__":
    main()
