"""Which cluster the planner plans on: `resolve_cluster` (a preset, a TOML file, or empty for
the calibrated file at its documented place, else the ``cpu`` preset); the ``cpu`` preset's
device count is this machine's; ranks beyond the cores share them. Pure: nothing spawns."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tessera.planner import PRESETS, Job, Layout, ModelShape, check, cluster_to_toml, estimate
from tessera.planner.cluster import calibrated_path, resolve_cluster


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty XDG config home: no calibrated file unless a test writes one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_the_cpu_preset_has_one_device_per_core_of_this_machine() -> None:
    assert PRESETS["cpu"].devices_per_node == (os.cpu_count() or 1)
    assert PRESETS["cpu"].world_size == (os.cpu_count() or 1)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("crowding", [0.0, 0.25])
def test_ranks_beyond_the_cores_stretch_by_their_share_and_the_crowding(ranks: int, crowding: float) -> None:
    """On a host of 2 cores (``node_flops``) ``x = ranks / 2`` ranks share each core once they
    outnumber the cores, and a rank's work stretches by ``x (1 + crowding (x - 1))``; a rank's
    own FLOP/s and links are those of a core of its own; GPU nodes share nothing."""
    base = PRESETS["cpu"]
    cpu = dataclasses.replace(base, devices_per_node=2, node_flops=2 * base.flops_fp32, crowding=crowding)
    x = max(1.0, ranks / 2)
    assert cpu.ranks_per_core(ranks) == pytest.approx(x, rel=1e-12)
    assert cpu.crowd(ranks) == pytest.approx(x * (1 + crowding * (x - 1)), rel=1e-12)
    assert cpu.device_flops("fp32") == cpu.flops_fp32 * cpu.efficiency
    assert cpu.link(2, ranks) == (cpu.intra_latency, cpu.intra_bandwidth)
    gpu = dataclasses.replace(PRESETS["a100-80g"], crowding=crowding)
    assert gpu.crowd(ranks) == 1.0
    assert gpu.link(2, ranks) == (gpu.intra_latency, gpu.intra_bandwidth)
    assert gpu.device_flops("bf16") == gpu.flops * gpu.efficiency


def test_a_cluster_file_from_before_crowding_says_to_calibrate_again(tmp_path: Path) -> None:
    file = tmp_path / "old.toml"
    file.write_text('[cluster]\npreset = "cpu"\nwait_s = 3.7e-5\n')
    with pytest.raises(
        ValueError, match=r"\['wait_s'\].*wait_s gave way to crowding: run `tessera plan --calibrate`"
    ):
        resolve_cluster(str(file))


def test_calibrated_path_follows_xdg_and_home() -> None:
    assert calibrated_path({"XDG_CONFIG_HOME": "/x"}) == Path("/x/tessera/cluster.toml")
    assert calibrated_path({"HOME": "/h"}) == Path("/h/.config/tessera/cluster.toml")


def test_empty_cluster_is_the_calibrated_file_else_cpu(config_home: Path) -> None:
    assert resolve_cluster("") == PRESETS["cpu"]
    calibrated = dataclasses.replace(PRESETS["cpu"], name="here", devices_per_node=3, flops=1e9)
    path = calibrated_path()
    assert path == config_home / "tessera" / "cluster.toml"
    path.parent.mkdir(parents=True)
    path.write_text(cluster_to_toml(calibrated))
    assert resolve_cluster("") == calibrated


def test_a_named_cluster_is_a_preset_or_a_file(tmp_path: Path) -> None:
    assert resolve_cluster("a100-80g") == PRESETS["a100-80g"]
    file = tmp_path / "mine.toml"
    file.write_text('[cluster]\npreset = "h100-80g"\ndevices_per_node = 4\n')
    assert resolve_cluster(str(file)) == dataclasses.replace(PRESETS["h100-80g"], devices_per_node=4)
    with pytest.raises(ValueError, match=r"'nowhere\.toml' is neither a preset"):
        resolve_cluster("nowhere.toml")


@pytest.mark.parametrize(
    "parallel",
    [
        {"dp": 2},
        {"dp": 4},
        {"dp": 8},
        {"tp": 4, "tp_mode": "2d"},
        {"dp": 2, "pp": 2, "microbatches": 4},
        {"dp": 4, "pp": 2, "microbatches": 2, "schedule": "zb-h1"},
    ],
)
def test_a_crowded_step_takes_each_ranks_work_stretched_by_the_crowd(parallel: dict[str, object]) -> None:
    """On a 2-core host, a step is at least each rank's work (compute, data-parallel traffic,
    optimizer step: not the bubble) times `Cluster.crowd`; one rank per core adds nothing;
    more crowding never makes a step faster; the GPU presets never crowd."""
    job = Job(ModelShape(layers=4, hidden=64, heads=4, vocab=64, seq=32, batch=16))
    layout = Layout(**{"microbatches": 1, "zero": 1, **parallel})  # type: ignore[arg-type]
    assert check(layout, job) == []
    base = dataclasses.replace(PRESETS["cpu"], devices_per_node=2, node_flops=2 * PRESETS["cpu"].flops_fp32)
    totals = []
    for crowding in (0.0, 0.1, 0.3):
        cpu = dataclasses.replace(base, crowding=crowding)
        t = estimate(layout, job, cpu).time
        work = t.compute + t.data_comm + t.optimizer
        crowd = cpu.crowd(layout.world_size)
        assert t.total == pytest.approx(max(crowd * work, work + t.bubble), rel=1e-12)
        if layout.world_size <= 2:
            assert t.crowding == 0.0
        totals.append(t.total)
    assert totals == sorted(totals)
    assert estimate(layout, job, PRESETS["a100-80g"]).time.crowding == 0.0
