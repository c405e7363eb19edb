"""Tier 0: hardware as data. Any `Cluster` round-trips through its TOML (`cluster_to_toml`,
`load_cluster`), every preset resolves by name and from a file, an unknown preset or field
is refused naming the known ones, every field out of range is refused by name; and the
calibration's fits recover the parameters of synthetic measurements made with exactly the
model they fit (latency + bytes / bandwidth; FLOPs / rate + operators * launch cost).
Pure: no process is spawned, the measurements are given."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.planner import PRESETS, Cluster, ModelShape, cluster_to_toml, load_cluster
from tessera.planner import calibrate as cal
from tessera.planner.cluster import GIB, resolve_cluster
from tessera.planner.operators import OPS_EDGE, OPS_LAYER

FIELDS = {f.name: f for f in dataclasses.fields(Cluster)}
INTEGERS = ("nodes", "devices_per_node")
POSITIVE = (
    "memory_gib", "flops", "flops_fp32", "efficiency", "intra_bandwidth", "inter_bandwidth",
    "memory_bandwidth", "host_bandwidth", "host_memory_bandwidth",
)  # fmt: skip
NUMBERS = tuple(name for name in FIELDS if name not in ("name", *INTEGERS))
KNOWN = ", ".join(sorted(PRESETS))

# any name: quotes, backslashes and control characters are escaped in the TOML
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)))


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    values: dict[str, Any] = {"name": draw(names)}
    for name in INTEGERS:
        values[name] = draw(st.integers(1, 10**6))
    for name in NUMBERS:
        low = 1e-300 if name in POSITIVE else 0.0
        values[name] = draw(
            st.one_of(
                st.integers(math.ceil(low), 10**12), st.floats(low, allow_nan=False, allow_infinity=True)
            )
        )
    return Cluster(**values)


@settings(max_examples=150, deadline=None)
@given(cluster=clusters())
def test_any_cluster_round_trips_through_its_toml(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("c") / "cluster.toml"
    path.write_text(cluster_to_toml(cluster), encoding="utf-8")
    assert load_cluster(str(path)) == cluster
    assert resolve_cluster(str(path)) == cluster


@pytest.mark.parametrize("name", ['the "big" one', "C:\\tmp\\box", "tab\there", "ünïcode"])
def test_a_name_with_quotes_or_backslashes_round_trips(name: str, tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_to_toml(Cluster(name=name)), encoding="utf-8")
    assert load_cluster(str(path)).name == name


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_resolves_by_name_and_from_a_file(preset: str, tmp_path: Path) -> None:
    """By name: the preset itself; a file naming it: the preset, with any field overridden;
    its own TOML: itself."""
    assert load_cluster(preset) is PRESETS[preset] and resolve_cluster(preset) is PRESETS[preset]
    path = tmp_path / "c.toml"
    path.write_text(f'[cluster]\npreset = "{preset}"\n')
    assert load_cluster(str(path)) == PRESETS[preset]
    path.write_text(f'[cluster]\npreset = "{preset}"\nnodes = 3\nmemory_gib = 12.5\n')
    assert load_cluster(str(path)) == dataclasses.replace(PRESETS[preset], nodes=3, memory_gib=12.5)
    path.write_text(cluster_to_toml(PRESETS[preset]))
    assert load_cluster(str(path)) == PRESETS[preset]


def test_the_gpu_presets_carry_the_vendors_figures() -> None:
    """The module docstring's dense peaks (A100: 312 TFLOP/s bf16, 19.5 fp32; H100 and H200
    SXM: 989 and 67), 80 GiB but the H200's 141, eight devices a node; a rank's FLOP/s are
    the peak at its precision times the efficiency."""
    peaks = {"a100-80g": (312e12, 19.5e12, 80.0), "h100-80g": (989e12, 67e12, 80.0)}
    peaks["h200-141g"] = (989e12, 67e12, 141.0)
    for name, (bf16, fp32, gib) in peaks.items():
        c = PRESETS[name]
        assert (c.flops, c.flops_fp32, c.memory_gib, c.devices_per_node) == (bf16, fp32, gib, 8)
        assert c.memory_bytes == gib * GIB
        assert c.device_flops("bf16") == bf16 * c.efficiency and c.device_flops("fp32") == fp32 * c.efficiency
        assert c.name == name


def test_an_unknown_preset_or_spec_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\npreset = "tpu-v5"\n')
    with pytest.raises(ValueError, match=re.escape(f"unknown preset 'tpu-v5'; known: {KNOWN}")):
        load_cluster(str(path))
    with pytest.raises(
        ValueError, match=re.escape(f"cluster 'tpu-v5' is neither a preset ({KNOWN}) nor a file")
    ):
        load_cluster("tpu-v5")
    path.write_text("[nodes]\ncount = 2\n")
    with pytest.raises(ValueError, match=r"needs a \[cluster\] table"):
        load_cluster(str(path))
    path.write_text("[cluster]\nflop = 1e12\nlatency = 1\n")
    with pytest.raises(
        ValueError, match=r"unknown cluster field\(s\) \['flop', 'latency'\]; known: \[.*'flops'"
    ):
        load_cluster(str(path))


@pytest.mark.parametrize("field", NUMBERS)
@pytest.mark.parametrize("bad", [-1.0, float("nan"), "fast"])
def test_a_number_out_of_range_is_refused_by_name(field: str, bad: object, tmp_path: Path) -> None:
    """Negative, NaN or not a number: refused naming the field and the value, built directly
    or read from a file; the fields a device cannot do without must also be above 0."""
    with pytest.raises(
        ValueError, match=rf"cluster\.{field} must be a number >= 0, got {re.escape(repr(bad))}"
    ):
        Cluster(**{field: bad})  # type: ignore[arg-type]
    if field in POSITIVE:
        with pytest.raises(ValueError, match=rf"cluster\.{field} must be > 0, got 0"):
            Cluster(**{field: 0})  # type: ignore[arg-type]
    else:
        assert getattr(Cluster(**{field: 0}), field) == 0  # type: ignore[arg-type]
    path = tmp_path / "c.toml"
    path.write_text(f"[cluster]\n{field} = -1.0\n")
    with pytest.raises(ValueError, match=rf"cluster\.{field} must be a number >= 0, got -1\.0"):
        load_cluster(str(path))


@pytest.mark.parametrize("field", INTEGERS)
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_a_count_that_is_not_a_positive_integer_is_refused(field: str, bad: object) -> None:
    with pytest.raises(
        ValueError, match=rf"cluster\.{field} must be an integer >= 1, got {re.escape(repr(bad))}"
    ):
        Cluster(**{field: bad})  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(per_node=st.integers(1, 64), nodes=st.integers(1, 64), world=st.integers(1, 5000))
def test_nodes_fill_up_first_and_a_world_gets_enough_of_them(per_node: int, nodes: int, world: int) -> None:
    """`with_world` takes the fewest nodes that hold ``world`` ranks; `ranks_per_node` fills a
    node before the next, and puts a world too large for the cluster on the nodes it has;
    a group is inside a node exactly when it spans no more ranks than a node holds."""
    cluster = Cluster(nodes=nodes, devices_per_node=per_node)
    grown = cluster.with_world(world)
    assert grown.world_size >= world and (grown.nodes - 1) * per_node < world
    assert dataclasses.replace(grown, nodes=nodes) == cluster
    here = cluster.ranks_per_node(world)
    assert here * nodes >= world and here >= min(world, per_node)
    if world <= cluster.world_size:
        assert here == min(world, per_node)
    for span in (1, per_node, per_node + 1):
        inside = span <= max(per_node, here)
        assert cluster.inside(span, here) == inside
        want = (
            (cluster.intra_latency, cluster.intra_bandwidth)
            if inside
            else (cluster.inter_latency, cluster.inter_bandwidth)
        )
        assert cluster.link(span, here) == want


# ------------------------------------------------------------------ calibration fits
def _answer(monkeypatch: pytest.MonkeyPatch, times: dict[str, tuple[float, ...]]) -> list[str]:
    """`_all_reduce_times` answers ``times[op]`` for the sizes asked; returns the ops asked."""
    asked: list[str] = []

    def fake(world: int, sizes: tuple[int, ...], op: str = "all_reduce") -> list[float]:
        assert world == 2
        asked.append(op)
        answer = times[op]
        assert len(answer) == len(sizes)
        return list(answer)

    monkeypatch.setattr(cal, "_all_reduce_times", fake)
    return asked


# The fits subtract the small time from the large one: round-off of at most eps * large /
# (large - small), below 1e-11 over these ranges; 1e-9 leaves room.
FIT = 1e-9
latency = st.floats(1e-6, 1e-2)
bandwidth = st.floats(1e7, 1e12)


@settings(max_examples=100, deadline=None)
@given(lat=latency, bw=bandwidth, passes=st.sampled_from([1, 2]))
def test_the_link_fit_recovers_latency_and_bandwidth(lat: float, bw: float, passes: int) -> None:
    """A call of ``n`` bytes taking ``2 latency + passes * n / bandwidth`` (a 2-rank
    all-reduce: one pass; a message there and back: two) at the small and the large size."""
    with pytest.MonkeyPatch.context() as mp:
        model = tuple(2 * lat + passes * n / bw for n in (cal.SMALL, cal.LARGE))
        asked = _answer(mp, {"p2p": model})
        got = cal._fit("p2p", passes)
    assert asked == ["p2p"]
    assert got == pytest.approx((lat, bw), rel=FIT)


@settings(max_examples=100, deadline=None)
@given(lat=latency, bw=bandwidth)
def test_the_all_to_all_fit_recovers_its_terms(lat: float, bw: float) -> None:
    """An all-to-all between two ranks sends half its buffer: ``latency + n / 2 / bandwidth``."""
    with pytest.MonkeyPatch.context() as mp:
        _answer(mp, {"all_to_all": tuple(lat + n / 2 / bw for n in (cal.SMALL, cal.LARGE))})
        got = cal._all_to_all()
    assert got == pytest.approx((lat, bw), rel=FIT)


@settings(max_examples=100, deadline=None)
@given(lat=latency, bw=bandwidth, back_to_back=st.floats(0.05, 1.0))
def test_the_node_link_takes_its_bandwidth_back_to_back_and_its_latency_between_computations(
    lat: float, bw: float, back_to_back: float
) -> None:
    """`_link`: the bandwidth from back-to-back all-reduces (whose latency is a fraction of
    a step's), the latency from one all-reduce between computations, as a step meets it."""
    quick = back_to_back * lat
    times = {
        "all_reduce": tuple(2 * quick + n / bw for n in (cal.SMALL, cal.LARGE)),
        "between": (2 * lat + cal.SMALL / bw,),
    }
    with pytest.MonkeyPatch.context() as mp:
        asked = _answer(mp, times)
        got = cal._link()
    assert asked == ["all_reduce", "between"]
    assert got == pytest.approx((lat, bw), rel=FIT)


def test_a_fit_never_gives_a_latency_below_a_tenth_of_a_microsecond(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small call measured faster than its bytes allow (noise) would fit a negative
    latency: the fit keeps 1e-7 s instead, and the bandwidth as measured."""
    bw = 1e9
    _answer(monkeypatch, {"all_reduce": (cal.SMALL / bw / 2, cal.LARGE / bw - cal.SMALL / bw / 2)})
    lat, got_bw = cal._fit("all_reduce", 1)
    assert lat == 1e-7 and got_bw == pytest.approx(bw, rel=FIT)


@pytest.mark.parametrize(("ratio", "crowding"), [(2.0, 0.0), (2.2, 0.1), (3.0, 0.5), (1.7, 0.0)])
def test_crowding_is_what_twice_the_ranks_cost_beyond_twice_the_time(
    monkeypatch: pytest.MonkeyPatch, ratio: float, crowding: float
) -> None:
    """Twice the ranks per core take ``2 (1 + crowding)`` times as long; faster than twice
    (noise) is no crowding. Rel 1e-12: one division and subtraction."""
    monkeypatch.setattr(cal, "_spawn", lambda target, world, *args: [ratio] if world == 4 else [])
    assert cal._crowding(2) == pytest.approx(crowding, rel=1e-12, abs=1e-15)


def test_the_compute_fit_recovers_the_rate_and_the_launch_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """`calibrate` solves ``t = FLOPs / rate + operators * launch`` from a tiny and a medium
    profile of the reference GPT, and the bf16 rate from the medium one again: given
    profiles made with that model (and the links, crowding and split measured as above),
    the cluster it writes carries the rate, launch cost and bf16 rate they were made with.
    Rel 1e-9: a 2 x 2 solve of times whose parts differ by a few orders of magnitude."""
    rate, launch, rate_bf16 = 3.2e10, 9e-6, 5.1e10

    def profile(
        layers: int, hidden: int, seq: int, rows: int, bf16: bool = False
    ) -> tuple[float, float, float]:
        flops = ModelShape(layers=layers, hidden=hidden, heads=4, vocab=128, seq=seq, batch=rows).step_flops()
        ops = 3.0 * (layers * OPS_LAYER + 2 * OPS_EDGE)
        return flops / (rate_bf16 if bf16 else rate) + ops * launch, flops, ops

    copy_s = 2e-3  # 16 MiB read and written: 2 * 16 MiB / copy_s bytes/s
    monkeypatch.setattr(cal, "_profile", profile)
    monkeypatch.setattr(cal, "_median", lambda fn, iters, budget_s=float("inf"): copy_s)
    monkeypatch.setattr(cal, "_split_overhead", lambda: 0.25)
    monkeypatch.setattr(cal, "_link", lambda: (6e-5, 5e9))
    monkeypatch.setattr(cal, "_crowding", lambda cores: 0.1)
    monkeypatch.setattr(
        cal, "_fit", lambda op, passes: {"gloo_all_reduce": (2e-4, 1e9), "p2p": (4e-5, 3e9)}[op]
    )
    monkeypatch.setattr(cal, "_all_to_all", lambda: (8e-5, 1.6e9))
    got = cal.calibrate()
    assert got.flops_fp32 == pytest.approx(rate, rel=1e-9)
    assert got.op_overhead_s == pytest.approx(launch, rel=1e-9)
    assert got.flops == pytest.approx(rate_bf16, rel=1e-9)
    cores = PRESETS["cpu"].devices_per_node
    assert got.node_flops == pytest.approx(rate * cores, rel=1e-9) and got.efficiency == 1.0
    assert got.memory_bandwidth == got.host_bandwidth == got.host_memory_bandwidth == 2 * 16 * 2**20 / copy_s
    assert (got.intra_latency, got.intra_bandwidth, got.inter_latency, got.inter_bandwidth) == (
        6e-5,
        5e9,
        2e-4,
        1e9,
    )
    assert (got.p2p_latency, got.p2p_bandwidth, got.a2a_latency, got.a2a_bandwidth) == (
        4e-5,
        3e9,
        8e-5,
        1.6e9,
    )
    assert (got.crowding, got.split_overhead, got.overlap) == (0.1, 0.25, 0.0)
    assert got.devices_per_node == cores and got.name == "cpu-calibrated"
    assert cluster_to_toml(got).startswith('[cluster]\nname = "cpu-calibrated"\n')
