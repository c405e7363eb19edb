"""The launcher's side of the planner (`tessera.launcher.config.auto`, `tessera plan`): every
configuration the search emits is one the launcher accepts, the winner fits, a shape the
search refuses whole holds no configuration the launcher accepts, ``tessera plan`` writes a
config that loads, ``parallel.auto`` runs the planner's choice, and a 1000-device search
returns. Pure (no processes) except the CLI's subprocess and ``--calibrate``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.launcher.config import Config, DataConfig, ModelConfig, ParallelConfig
from tessera.launcher.config.auto import auto_config, config_of, job_of, layout_of, search_config, validator
from tessera.launcher.config.config_io import resolve_config
from tessera.launcher.run.cli import main
from tessera.planner import PRESETS, load_cluster
from tessera.planner.search import _parallel_variants, _schedules, _tp_shapes, _Validator, divisors

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
    result = search_config(base, cluster, world=world)
    assert result.ranked, "the reference GPT always fits a few GiB"
    for cand in (*result.ranked, *result.too_big):
        config = config_of(base, cand.layout)
        assert config.validate() == []
        assert config.world_size == world
        assert config.model == base.model and config.data == base.data
        assert layout_of(config) == cand.layout  # the adapter's two ways agree
    times = [c.step_time for c in result.ranked]
    assert times == sorted(times)
    assert all(c.estimate.memory.device <= cluster.memory_bytes for c in result.ranked)
    assert all(c.estimate.memory.device > cluster.memory_bytes for c in result.too_big)


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
        "import sys\nfrom tessera.launcher.run.cli import main\n"
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
    result = search_config(base, cluster)
    assert result.best is not None
    best = config_of(base, result.best.layout)
    assert best.world_size == 1000
    assert best.validate() == []


@pytest.mark.slow  # the calibration times this machine's collectives over real processes
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
    planned = config_of(auto, best.layout)
    assert (chosen.parallel, chosen.zero) == (
        dataclasses.replace(planned.parallel, auto=False, cluster=""),
        planned.zero,
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


def test_parallel_auto_runs_recomputation_when_its_choice_needs_it() -> None:
    """Under a budget that only recomputation fits, the chosen configuration turns activation
    checkpointing on (its memory was predicted with it); with room, it stays off."""
    base = Config(
        model=ModelConfig(vocab_size=64, seq_len=256, d_model=256, n_heads=4, n_layers=8),
        data=DataConfig(batch_size=64),
        parallel=ParallelConfig(auto=True),
    )
    roomy, best = auto_config(base, 2, dataclasses.replace(PRESETS["cpu"], memory_gib=4))
    assert not best.layout.recompute and roomy.train.activation_checkpointing is False
    tight, best = auto_config(base, 2, dataclasses.replace(PRESETS["cpu"], memory_gib=0.03))
    assert best.layout.recompute, best.label()
    assert tight.train.activation_checkpointing is True
    assert tight.validate() == []


@settings(max_examples=25, deadline=None)
@given(
    world=st.sampled_from([2, 4, 6, 8, 12]),
    heads=st.sampled_from([1, 2, 3, 4, 6]),
    seq=st.sampled_from([8, 12, 16]),
    batch=st.sampled_from([4, 6, 8]),
    layers=st.integers(1, 4),
)
def test_a_shape_refused_whole_holds_no_valid_configuration(
    world: int, heads: int, seq: int, batch: int, layers: int
) -> None:
    """Every configuration of a refused tensor-parallel shape (every split of the rest of the
    world, variant, schedule and microbatch count) is one ``Config.validate()`` refuses; and
    with ZeRO stage 0 (what the shortcut asks) as with any stage."""
    base = Config(
        model=ModelConfig(vocab_size=64, seq_len=seq, d_model=8 * heads, n_heads=heads, n_layers=layers),
        data=DataConfig(batch_size=batch),
    )
    valid = _Validator(job_of(base), validator(base))
    for shape in _tp_shapes(world, ("1d", "2d", "2.5d", "3d")):
        if not valid.refused_shape(shape, world):
            continue
        rest = world // shape.tp
        for cp in divisors(rest):
            for pp in divisors(rest // cp):
                dp = rest // cp // pp
                for parallel in _parallel_variants(shape, dp, pp, cp, seq, False):
                    for name, v in _schedules(pp, 3):
                        for m in divisors(batch):
                            par = dataclasses.replace(
                                parallel, schedule=name, virtual_stages=v, microbatches=m, zero=1
                            )
                            assert config_of(base, par).validate(), par
