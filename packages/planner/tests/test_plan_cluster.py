"""Which cluster the planner plans on: `resolve_cluster` (a preset, a TOML file, or empty for
the calibrated file at its documented place, else the ``cpu`` preset); the ``cpu`` preset's
device count is this machine's; ranks beyond the cores share them. Pure: nothing spawns."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tessera.planner import PRESETS, cluster_to_toml
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
def test_ranks_beyond_the_cores_share_their_flops_and_bandwidth(ranks: int) -> None:
    """On a host of 2 cores (``node_flops``) a rank gets 2/ranks of a core once ranks exceed
    the cores: of its FLOP/s and of its loopback bandwidth alike; GPU nodes share nothing."""
    cpu = dataclasses.replace(PRESETS["cpu"], devices_per_node=2, node_flops=2 * PRESETS["cpu"].flops_fp32)
    share = min(1.0, 2 / ranks)
    assert cpu.core_share(ranks) == pytest.approx(share, rel=1e-12)
    assert cpu.device_flops("fp32", ranks) == pytest.approx(cpu.flops_fp32 * share, rel=1e-12)
    assert cpu.link(2, ranks)[1] == pytest.approx(cpu.intra_bandwidth * share, rel=1e-12)
    gpu = PRESETS["a100-80g"]
    assert gpu.link(2, ranks)[1] == gpu.intra_bandwidth
    assert gpu.device_flops("bf16", ranks) == gpu.flops * gpu.efficiency


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
