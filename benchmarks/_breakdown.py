"""Where one rank's step time goes, from a torch.profiler Chrome trace of N steps.

``profile_steps`` runs ``step()`` N times under ``torch.profiler`` (CPU activity, every thread
of the process), each step inside a ``record_function`` range named ``STEP``, and writes the
Chrome trace. ``breakdown`` reads such a trace back and splits the wall time of each step on
the *main thread* (the thread that ran the ``STEP`` ranges) into four categories, each
instant of a step counted once, by the first rule that holds at that instant:

1. **communication**, if the main thread is inside a communication range: a Tessera
   collective or p2p post (``tessera.comm.*``: the whole call, its copies and ring combines
   included, and ``tessera.comm.wait``, the wait of a ``Handle``), a torch c10d op
   (``c10d::*``; ``_c10d_functional::*``: DTensor's collectives and their ``wait_tensor``;
   ``record_param_comms``), or a backend range (``gloo:*`` other than
   ``gloo:send`` / ``gloo:recv``, ``nccl:*``) recorded on the main thread.
2. **idle**, if it is inside ``tessera.p2p.wait`` (a wait for a peer's point-to-point
   message: the pipeline runtime's, or a p2p ``Handle.wait()``).
3. **compute**, if it is inside any other CPU op (``cpu_op`` events: aten ops, autograd's
   ``evaluate_function`` nodes, optimizer kernels).
4. No op on the main thread (it runs Python, or blocks without an event):
   **idle** if a blocking receive (``gloo:recv``) is open on the main thread (torch's p2p
   waiting for its peer); else **communication** if a collective is in flight anywhere in
   the process (a ``gloo:*`` / ``nccl:*`` range on any thread: gloo's run-loop threads, or
   a ``tessera.comm.*`` range on another thread: an async gloo ring on its lane), since torch
   records no event while a thread blocks in ``Work.wait()``. Posted p2p transfers
   (``gloo:send``, ``tessera.p2p.wait`` on a waiter thread) do not count as in flight: an
   open receive waits for the peer, it is not work;
   else **overhead**: Python dispatch, hooks, module calls, allocator and interpreter time
   between ops.

Rule 4's in-flight test charges to communication any Python the main thread runs while an
async collective is open (DDP's bucketed all-reduces during backward, a ``Handle`` not yet
waited): it bounds communication from above and overhead from below. Profiling adds its own
cost per op (a few microseconds) to compute and overhead alike: compare categories between
systems profiled the same way, not against unprofiled step times.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STEP = "tessera.bench.step"
CATEGORIES = ("compute", "communication", "idle", "overhead")
_COMM, _IDLE_RANGE, _OP, _IDLE_GAP, _IN_FLIGHT = 5, 4, 3, 2, 1  # rule priority, highest first
_CATEGORY_OF = {
    _COMM: "communication",
    _IDLE_RANGE: "idle",
    _OP: "compute",
    _IDLE_GAP: "idle",
    _IN_FLIGHT: "communication",
    0: "overhead",
}
_P2P = ("gloo:send", "gloo:recv")
_C10D = ("c10d::", "_c10d_functional::", "c10d_functional::")  # process-group and functional ops


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Mean seconds per step by category over ``steps`` steps of one rank's main thread."""

    steps: int
    step_s: float
    compute_s: float
    communication_s: float
    idle_s: float
    overhead_s: float

    def fractions(self) -> dict[str, float]:
        """Each category's share of the step (they sum to 1)."""
        total = self.step_s or 1.0
        return {c: getattr(self, f"{c}_s") / total for c in CATEGORIES}

    def as_record(self) -> dict[str, Any]:
        """The JSON form: seconds per step (rounded to the microsecond) and fractions."""
        rec: dict[str, Any] = {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}
        rec["fractions"] = {k: round(v, 4) for k, v in self.fractions().items()}
        return rec


def _is_collective(name: str) -> bool:
    """A Tessera collective range, or a backend collective (gloo/NCCL, not their p2p)."""
    if name.startswith(("tessera.comm.", "nccl:")):
        return True
    return name.startswith("gloo:") and name not in _P2P


def classify(event: Mapping[str, Any], main_tid: Any) -> int:
    """The rule (priority) an event's interval asserts; 0 when it asserts none."""
    name, on_main = str(event.get("name", "")), event.get("tid") == main_tid
    if not on_main:  # other threads: only a collective at work counts (rule 4)
        return _IN_FLIGHT if _is_collective(name) else 0
    if _is_collective(name) or name.startswith(_C10D) or name == "record_param_comms":
        return _COMM
    if name == "tessera.p2p.wait":
        return _IDLE_RANGE
    if event.get("cat") == "cpu_op":
        return _OP
    return _IDLE_GAP if name == "gloo:recv" else 0


def split_window(
    events: Iterable[Mapping[str, Any]], start: float, end: float, main_tid: Any
) -> dict[str, float]:
    """Microseconds of ``[start, end)`` in each category (see the module docstring)."""
    edges: list[tuple[float, int, int]] = []  # (time, priority, +1 opens / -1 closes)
    for ev in events:
        prio = classify(ev, main_tid)
        if not prio:
            continue
        lo, hi = max(float(ev["ts"]), start), min(float(ev["ts"]) + float(ev.get("dur", 0.0)), end)
        if hi > lo:
            edges += [(lo, prio, 1), (hi, prio, -1)]
    edges.sort(key=lambda e: (e[0], e[2]))
    open_count = [0] * 6
    out = dict.fromkeys(CATEGORIES, 0.0)
    t = start
    for when, prio, delta in edges:
        if when > t:
            top = max((p for p in range(5, 0, -1) if open_count[p]), default=0)
            out[_CATEGORY_OF[top]] += when - t
            t = when
        open_count[prio] += delta
    out["overhead"] += max(0.0, end - t)
    return out


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The complete ("X") events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def breakdown(events: Sequence[Mapping[str, Any]], *, skip: int = 0) -> Breakdown:
    """Split each ``STEP`` range of the trace (after the first ``skip``) by category; the mean."""
    steps = sorted((e for e in events if e.get("name") == STEP), key=lambda e: float(e["ts"]))[skip:]
    if not steps:
        raise ValueError(f"the trace has no {STEP!r} ranges after skipping {skip}")
    tids = {s.get("tid") for s in steps}
    if len(tids) != 1:
        raise ValueError(f"the {STEP!r} ranges come from {len(tids)} threads; expected one main thread")
    main_tid, pid = steps[0].get("tid"), steps[0].get("pid")
    mine = [e for e in events if e.get("pid") == pid and e.get("name") != STEP]
    per_step = []
    for s in steps:
        start = float(s["ts"])
        end = start + float(s["dur"])
        inside = [
            e for e in mine if float(e["ts"]) < end and float(e["ts"]) + float(e.get("dur", 0.0)) > start
        ]
        per_step.append((end - start, split_window(inside, start, end, main_tid)))
    mean = {c: statistics.fmean(parts[c] for _, parts in per_step) / 1e6 for c in CATEGORIES}
    return Breakdown(
        steps=len(per_step),
        step_s=statistics.fmean(w for w, _ in per_step) / 1e6,
        compute_s=mean["compute"],
        communication_s=mean["communication"],
        idle_s=mean["idle"],
        overhead_s=mean["overhead"],
    )


def profile_steps(
    step: Callable[[], object],
    steps: int,
    trace: str | Path,
    *,
    before: Callable[[], object] | None = None,
) -> Breakdown:
    """Run ``step()`` ``steps`` times under the profiler, write the Chrome trace to ``trace``,
    and return its breakdown. ``before()`` runs ahead of each step, outside its range (a
    barrier that lines the ranks up). Collective steps: every rank must call this alike."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    kwargs: dict[str, Any] = {}
    try:
        from torch._C._profiler import _ExperimentalConfig

        kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # older torch: the main thread and the run-loops only
        pass
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, **kwargs) as prof:
        for _ in range(steps):
            if before is not None:
                before()
            with record_function(STEP):
                step()
    Path(trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return breakdown(load_trace(trace))


def add_breakdown_args(parser: argparse.ArgumentParser, bench: str, what: str = "each system") -> None:
    """The options every bench with a step breakdown takes: ``--breakdown``,
    ``--breakdown-steps``, ``--out`` (see ``breakdown_folder``)."""
    parser.add_argument("--breakdown", action="store_true", help=f"profile {what}: see above")
    parser.add_argument("--breakdown-steps", type=int, default=3)
    parser.add_argument("--out", default=None, help=f"run folder (default benchmarks/out/{bench}-<time>)")


def breakdown_folder(args: argparse.Namespace, bench: str) -> str | None:
    """The run folder of a ``--breakdown`` run (``run_folder``), None without one."""
    return str(run_folder(bench, args.out)) if args.breakdown else None


def run_folder(bench: str, given: str | None = None) -> Path:
    """The run folder for traces and pictures: ``given``, or ``benchmarks/out/<bench>-<UTC time>``
    (``benchmarks/out`` is git-ignored); created."""
    import datetime

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    folder = Path(given) if given else Path(__file__).resolve().parent / "out" / f"{bench}-{stamp}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def plot(bars: Mapping[str, Breakdown], path: str | Path, title: str) -> None:
    """A stacked bar per label: seconds per step by category, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) + 2), 4.5))
    bottom = [0.0] * len(labels)
    colors = {"compute": "#4c72b0", "communication": "#dd8452", "idle": "#c44e52", "overhead": "#8c8c8c"}
    for cat in CATEGORIES:
        values = [getattr(bars[k], f"{cat}_s") * 1e3 for k in labels]
        ax.bar(labels, values, bottom=bottom, label=cat, color=colors[cat])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms per step (profiled)")
    ax.set_title(title)
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
