"""The planner's search and CLI: every configuration it emits is one the launcher accepts,
the winner fits, the pipeline extrapolation agrees with the simulator, ``tessera plan``
writes a config that loads, and a 1000-device search returns. Pure (no processes) except
the CLI's subprocess and ``--calibrate``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.launcher.cli import main
from tessera.launcher.config import Config, DataConfig, ModelConfig, ParallelConfig, ZeroConfig
from tessera.launcher.config_io import resolve_config
from tessera.launcher.plan import (
    PRESETS,
    Cluster,
    ModelShape,
    cluster_to_toml,
    estimate,
    load_cluster,
    search,
)
from tessera.launcher.plan.auto import auto_config
from tessera.launcher.plan.bubble import EXACT_LIMIT, pipeline_profile
from tessera.pipeline import Costs, build_schedule, simulate, unsplit

SMALL = Config(
    model=ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2),
    data=DataConfig(batch_size=8),
)


@settings(max_examples=15, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4, 8]),
    layers=st.integers(1, 6),
    heads=st.sampled_from([1, 2, 4, 8]),
    batch=st.sampled_from([4, 8, 16]),
    precision=st.sampled_from(["fp32", "bf16"]),
)
def test_every_candidate_validates_and_the_winner_fits(
    world: int, layers: int, heads: int, batch: int, precision: str
) -> None:
    base = Config(
        model=ModelConfig(vocab_size=64, seq_len=16, d_model=8 * heads, n_heads=heads, n_layers=layers),
        data=DataConfig(batch_size=batch),
    )
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, precision=precision))
    cluster = PRESETS["cpu"]
    result = search(base, cluster, world=world)
    assert result.ranked, "the reference GPT always fits a few GiB"
    for cand in (*result.ranked, *result.too_big):
        assert cand.config.validate() == []
        assert cand.config.world_size == world
        assert cand.config.model == base.model and cand.config.data == base.data
    times = [c.step_time for c in result.ranked]
    assert times == sorted(times)
    assert all(c.estimate.memory.device <= cluster.memory_bytes for c in result.ranked)
    assert all(c.estimate.memory.device > cluster.memory_bytes for c in result.too_big)


def test_a_device_too_small_leaves_only_configurations_that_do_not_fit() -> None:
    tiny = dataclasses.replace(PRESETS["cpu"], memory_gib=1e-6)
    result = search(SMALL, tiny, world=2)
    assert not result.ranked and result.best is None
    assert result.pruned + result.overflow + len(result.too_big) > 0


def test_more_sharding_never_predicts_more_model_state() -> None:
    model = ModelShape.from_config(SMALL)
    states = []
    for stage in range(4):
        config = dataclasses.replace(
            SMALL, parallel=ParallelConfig(dp=4, microbatches=1), zero=ZeroConfig(stage)
        )
        states.append(estimate(config, model, PRESETS["cpu"]).memory.model_state)
    assert states == sorted(states, reverse=True) and states[0] > states[-1]


@pytest.mark.parametrize(
    ("name", "p", "v"),
    [("1f1b", 4, None), ("gpipe", 4, None), ("interleaved-1f1b", 4, 2), ("zb-h1", 4, None), ("zbv", 4, 2)],
)
def test_extrapolated_pipelines_match_the_simulator(name: str, p: int, v: int | None) -> None:
    """Past ``EXACT_LIMIT`` the profile is extrapolated from two small runs; for these
    schedules the steady state is exactly linear in m (same makespan to 1e-9)."""
    chunks = v or 1
    m = 20 * p
    assert p * m * chunks * 3 > EXACT_LIMIT
    got = pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0)
    want = simulate(build_schedule(name, p, m, v), Costs(f=1.0, b=1.0, w=1.0))
    assert got.extrapolated
    assert got.makespan == pytest.approx(want.makespan, rel=1e-9)
    assert got.peak_held == pytest.approx(tuple(float(x) for x in want.peak_held), rel=1e-9)


def test_cluster_toml_round_trips_and_names_unknown_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_to_toml(PRESETS["h100-80g"]))
    assert load_cluster(str(path)) == PRESETS["h100-80g"]
    path.write_text('[cluster]\npreset = "a100-80g"\nnodes = 4\n')
    assert load_cluster(str(path)).world_size == 32
    path.write_text("[cluster]\nbandwith = 1\n")
    with pytest.raises(ValueError, match="bandwith"):
        load_cluster(str(path))
    with pytest.raises(ValueError, match="devices_per_node"):
        Cluster(devices_per_node=0)


def test_the_cli_writes_a_winner_that_tessera_run_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.toml"
    model.write_text(
        "[model]\nvocab_size = 64\nseq_len = 16\nd_model = 32\nn_heads = 4\nn_layers = 2\n"
        "[data]\nbatch_size = 8\n"
    )
    out, png = tmp_path / "winner.toml", tmp_path / "chart.png"
    code = main(
        [
            "plan",
            "--config",
            str(model),
            "--cluster",
            "cpu",
            "--world",
            "4",
            "--top",
            "3",
            "--out",
            str(out),
            "--png",
            str(png),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "step s" in printed and "dp" in printed
    winner = resolve_config(out)  # what `tessera run --config` does: load and validate
    assert winner.world_size == 4
    assert winner.model == resolve_config(model).model
    assert png.stat().st_size > 0


def test_plan_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom tessera.launcher.cli import main\n"
        "assert main(['plan', '--set', 'model.vocab_size=64', '--set', 'data.batch_size=8']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, capture_output=True, timeout=120)


def test_a_thousand_device_search_returns() -> None:
    """125 DGX A100 nodes; a 40-head GPT whose sizes admit factors of 5. No timing assertion."""
    base = Config(
        model=ModelConfig(vocab_size=51200, seq_len=2048, d_model=5120, n_heads=40, n_layers=40),
        data=DataConfig(batch_size=1000),
    )
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, precision="bf16"))
    cluster = dataclasses.replace(PRESETS["a100-80g"], nodes=125)
    result = search(base, cluster)
    assert result.best is not None
    assert result.best.config.world_size == 1000
    assert result.best.config.validate() == []


def test_calibrate_writes_a_cluster_that_loads(tmp_path: Path) -> None:
    path = tmp_path / "here.toml"
    assert main(["plan", "--calibrate", str(path)]) == 0
    cluster = load_cluster(str(path))
    assert cluster.flops > 0 and cluster.intra_bandwidth > 0 and cluster.op_overhead_s > 0
    assert cluster.a2a_latency > 0 and cluster.a2a_bandwidth > 0  # the all-to-all was timed


def test_parallel_auto_runs_the_planners_choice(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no calibrated file: the cpu preset
    auto = dataclasses.replace(SMALL, parallel=ParallelConfig(auto=True))
    chosen, best = auto_config(auto, 4)
    assert chosen.parallel.auto is False and chosen.world_size == 4
    assert chosen.validate() == []
    assert (chosen.parallel, chosen.zero) == (
        dataclasses.replace(best.config.parallel, auto=False, cluster=""),
        best.config.zero,
    )
    assert chosen.model == SMALL.model
    code = main(
        [
            "run",
            "--dry-run",
            "--set",
            "parallel.auto=true",
            "--set",
            "model.vocab_size=64",
            "--nproc-per-node",
            "4",
            "train.py",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]) == 4
    with pytest.raises(ValueError, match="fits 2 rank"):
        auto_config(auto, 2, dataclasses.replace(PRESETS["cpu"], memory_gib=1e-6))


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["1f1b", "gpipe", "zb-h1"]),
    p=st.integers(2, 4),
    m=st.integers(4, 8),
    scale=st.lists(st.sampled_from([0.5, 1.0, 1.5]), min_size=4, max_size=4),
)
def test_stage_scales_time_each_stage_by_its_work(name: str, p: int, m: int, scale: list[float]) -> None:
    """Per-stage costs (the planner's imbalance model): every rank is busy exactly its own
    stages' work, equal scales are the unscaled schedule stretched, and the makespan lies
    between the unscaled schedule at the smallest and at the largest scale."""
    schedule = build_schedule(name, p, m)
    scales = tuple(scale[:p])
    got = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0, stage_scale=scales))
    for rank in range(p):
        assert got.busy[rank] == pytest.approx(3.0 * m * scales[rank])
    flat = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0)).makespan
    same = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0, stage_scale=(1.5,) * p)).makespan
    assert same == pytest.approx(1.5 * flat)
    assert min(scales) * flat - 1e-9 <= got.makespan <= max(scales) * flat + 1e-9


@pytest.mark.parametrize(("name", "p", "v"), [("zb-h1", 4, None), ("zbv", 2, 2)])
@pytest.mark.parametrize("m", [8, 80])  # exact, and past EXACT_LIMIT (the lean replay's steady runs)
def test_split_costs_and_unsplit_forms_match_the_simulator(name: str, p: int, v: int | None, m: int) -> None:
    """A split backward's extra (`Costs.split`) and the `unsplit` form time as the pipeline's
    own simulator does, through both of the planner's paths (same makespan to 1e-9)."""
    chunks, costs = v or 1, Costs(f=1.0, b=1.0, w=1.0, split=0.3)
    schedule = build_schedule(name, p, m, v)
    for whole, form in ((False, schedule), (True, unsplit(schedule))):
        got = pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0, split=0.3, whole=whole)
        want = simulate(form, costs)
        assert got.makespan == pytest.approx(want.makespan, rel=1e-9), (whole, got.extrapolated)
    plain = pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0)
    assert pipeline_profile(name, p, m, chunks, 1.0, 1.0, 0.0, split=0.3).makespan > plain.makespan


def test_a_costly_split_slows_zero_bubble_and_tuning_caps_it() -> None:
    """``Cluster.split_overhead``: zero-bubble predicts slower with it; with ``tune_splits``
    (the runtime keeps only the splits that pay) never slower than the schedule unsplit,
    which for ZB-H1 is 1F1B's order: so never slower than 1F1B."""
    config = dataclasses.replace(
        SMALL,
        model=dataclasses.replace(SMALL.model, n_layers=6),
        parallel=ParallelConfig(pp=2, microbatches=8, schedule="zb-h1", tune_splits=0),
        data=DataConfig(batch_size=16),
    )
    model = ModelShape.from_config(config)
    free, costly = PRESETS["cpu"], dataclasses.replace(PRESETS["cpu"], split_overhead=0.5)
    zero = dataclasses.replace(free, split_overhead=0.0)

    def step(cfg: Config, cluster: Cluster) -> float:
        return estimate(cfg, model, cluster).time.total

    tuned = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tune_splits=2))
    one_f = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, schedule="1f1b"))
    assert step(config, zero) < step(one_f, zero), "a free split: zero-bubble beats 1F1B"
    assert step(config, costly) > step(config, zero)
    assert step(tuned, costly) <= step(config, costly)
    assert step(tuned, costly) == pytest.approx(step(one_f, costly), rel=1e-9)
