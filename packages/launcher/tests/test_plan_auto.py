"""Which cluster ``parallel.auto`` plans on: ``parallel.cluster`` (a preset, a TOML file, or
empty for the calibrated file at its documented place, else the ``cpu`` preset), refused
before anything spawns when unknown; the world is the processes per node times the nodes.
Pure: nothing spawns."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tessera.launcher.config import Config, DataConfig, ModelConfig, ParallelConfig
from tessera.launcher.config.auto import auto_config, auto_launch
from tessera.launcher.run.cli import main
from tessera.planner import PRESETS, cluster_to_toml
from tessera.planner.cluster import calibrated_path

SMALL = Config(
    model=ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2),
    data=DataConfig(batch_size=8),
)


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty XDG config home: no calibrated file unless a test writes one."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def _auto(cluster: str) -> Config:
    return dataclasses.replace(SMALL, parallel=ParallelConfig(auto=True, cluster=cluster))


def test_an_empty_cluster_plans_on_the_calibrated_file(config_home: Path) -> None:
    calibrated = dataclasses.replace(PRESETS["cpu"], name="here", devices_per_node=3, flops=1e9)
    path = calibrated_path()
    path.parent.mkdir(parents=True)
    path.write_text(cluster_to_toml(calibrated))
    _, _, per_node = auto_launch(_auto(""), None, 1)
    assert per_node == 3  # the calibrated file's devices, not the preset's


def test_a_named_cluster_sets_the_world_and_the_plan(config_home: Path, tmp_path: Path) -> None:
    chosen, _, per_node = auto_launch(_auto("a100-80g"), None, 2)
    assert per_node == 8 and chosen.world_size == 16
    assert chosen.parallel.cluster == "a100-80g" and chosen.parallel.auto is False
    assert chosen.validate() == []
    file = tmp_path / "mine.toml"
    file.write_text('[cluster]\npreset = "h100-80g"\ndevices_per_node = 4\n')
    _, _, per_node = auto_launch(_auto(str(file)), None, 1)
    assert per_node == 4
    # the planner's estimate depends on the cluster: the same world, another device
    on_cpu = auto_config(_auto("cpu"), 4)[1].estimate.time.total
    on_h100 = auto_config(_auto("h100-80g"), 4)[1].estimate.time.total
    assert on_h100 < on_cpu


def test_an_unknown_cluster_is_refused_before_anything_spawns(
    config_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=r"'nowhere\.toml' is neither a preset"):
        auto_launch(_auto("nowhere.toml"), 2, 1)
    code = main(
        [
            "run",
            "--dry-run",
            "--set",
            "parallel.auto=true",
            "--set",
            "parallel.cluster=nowhere.toml",
            "--set",
            "model.vocab_size=64",
            "train.py",
        ]
    )
    assert code == 2
    assert "nowhere.toml" in capsys.readouterr().err
