"""The step breakdown's attribution rules (benchmarks/_breakdown.py) on synthetic traces.

Exact: every interval is a whole number of microseconds, and the breakdown only adds and
subtracts them, so each category's seconds are compared with ``==`` after rounding away the
float conversion (1e-12 s).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_breakdown", ROOT / "benchmarks" / "_breakdown.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_breakdown"] = module
    spec.loader.exec_module(module)
    return module


bd = _load()
MAIN, RUNLOOP, LANE = 1, 2, 3


def ev(name: str, ts: float, dur: float, *, tid: int = MAIN, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def step(ts: float, dur: float) -> dict[str, Any]:
    return ev(bd.STEP, ts, dur, cat="user_annotation")


def us(parts: Any) -> dict[str, float]:
    return {c: round(getattr(parts, f"{c}_s") * 1e6, 6) for c in bd.CATEGORIES}


def test_each_rule_attributes_its_interval() -> None:
    """One 100 us step: an aten op (compute 10), a Tessera all-reduce range holding a clone
    and the enqueue (communication 20, the nested aten op included), an unrecorded wait while
    gloo's run-loop thread runs the collective (communication 15), a pipeline p2p wait (idle
    10), a gap with nothing in flight (overhead), torch p2p blocking on gloo:recv (idle 5),
    an op during an open gloo:recv (compute 5), a gap while a ring lane works (communication
    10), a gap with only a posted send and a waiter thread's p2p wait open (overhead)."""
    events = [
        step(0, 100),
        ev("aten::mm", 0, 10),
        ev("tessera.comm.all_reduce", 10, 20, cat="user_annotation"),
        ev("aten::clone", 12, 8),
        ev("c10d::allreduce_", 22, 2),
        ev("gloo:all_reduce", 22, 23, tid=RUNLOOP, cat="user_annotation"),  # done at 45
        ev("tessera.p2p.wait", 45, 10, cat="user_annotation"),
        # 55-60: nothing at all: overhead
        ev("gloo:recv", 60, 10, cat="user_annotation"),
        ev("aten::add", 65, 5),
        ev("tessera.comm.ring", 75, 10, tid=LANE, cat="user_annotation"),
        ev("tessera.p2p.wait", 85, 10, tid=LANE, cat="user_annotation"),  # a waiter thread: not work
        ev("gloo:send", 85, 10, cat="user_annotation"),  # a posted send: not work either
        # 70-75 open gloo:recv ended at 70 -> overhead; 75-85 lane busy -> communication
        # 85-100 overhead
    ]
    got = us(bd.breakdown(events))
    assert got == {"compute": 15.0, "communication": 45.0, "idle": 15.0, "overhead": 25.0}


def test_comm_range_wins_over_nested_ops_and_idle_over_ops() -> None:
    """Priority: a communication range over ops nested in it; a p2p wait range over an op."""
    events = [
        step(0, 50),
        ev("autograd::engine::evaluate_function: _CopyToRegionBackward", 0, 30),
        ev("tessera.comm.all_reduce", 5, 20, cat="user_annotation"),
        ev("aten::copy_", 6, 10),
        ev("tessera.p2p.wait", 30, 20, cat="user_annotation"),
        ev("aten::empty", 35, 1),
    ]
    assert us(bd.breakdown(events)) == {"compute": 10.0, "communication": 20.0, "idle": 20.0, "overhead": 0.0}


def test_torch_collectives_count_as_communication() -> None:
    """DTensor's functional collectives and their waits, and c10d ops, are communication."""
    events = [
        step(0, 30),
        ev("_c10d_functional::all_reduce", 0, 5),
        ev("_c10d_functional::wait_tensor", 5, 10),
        ev("c10d::allreduce_", 15, 5),
        ev("aten::mm", 20, 10),
    ]
    assert us(bd.breakdown(events)) == {"compute": 10.0, "communication": 20.0, "idle": 0.0, "overhead": 0.0}


def test_events_outside_the_step_and_other_processes_do_not_count() -> None:
    """Ops before the step, after it, or in another pid are ignored; clipped at the edges."""
    other = ev("aten::mm", 0, 100)
    other["pid"] = 8
    events = [step(10, 20), ev("aten::mm", 0, 15), ev("aten::mm", 25, 50), other]
    assert us(bd.breakdown(events)) == {"compute": 10.0, "communication": 0.0, "idle": 0.0, "overhead": 10.0}


def test_mean_over_steps_and_skip() -> None:
    """The breakdown is the mean over the steps left after ``skip``."""
    events = [step(0, 10), ev("aten::mm", 0, 10), step(20, 10), step(40, 30), ev("aten::mm", 40, 10)]
    result = bd.breakdown(events, skip=1)
    assert result.steps == 2
    assert us(result) == {"compute": 5.0, "communication": 0.0, "idle": 0.0, "overhead": 15.0}
    assert round(result.step_s * 1e6, 6) == 20.0


def test_no_steps_names_the_range() -> None:
    with pytest.raises(ValueError, match=r"tessera\.bench\.step"):
        bd.breakdown([ev("aten::mm", 0, 1)])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "aten::mm",
                    "tessera.comm.all_reduce",
                    "tessera.p2p.wait",
                    "gloo:recv",
                    "gloo:all_reduce",
                    "python_thing",
                ]
            ),
            st.integers(0, 99),
            st.integers(0, 40),
            st.sampled_from([MAIN, RUNLOOP]),
        ),
        max_size=30,
    )
)
def test_categories_partition_the_step(spans: list[tuple[str, int, int, int]]) -> None:
    """Whatever the events, the four categories are non-negative and sum to the step time."""
    events = [step(0, 100)] + [
        ev(n, ts, d, tid=t, cat="cpu_op" if n.startswith("aten") else "user_annotation")
        for n, ts, d, t in spans
    ]
    got = us(bd.breakdown(events))
    assert all(v >= 0 for v in got.values())
    assert round(sum(got.values()), 6) == 100.0


def test_load_trace_reads_a_chrome_trace(tmp_path: Path) -> None:
    """A Chrome trace file round-trips through load_trace (metadata events dropped)."""
    trace = {"traceEvents": [step(0, 10), ev("aten::mm", 0, 4), {"ph": "M", "name": "thread_name"}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    assert us(bd.breakdown(bd.load_trace(path))) == {
        "compute": 4.0,
        "communication": 0.0,
        "idle": 0.0,
        "overhead": 6.0,
    }
