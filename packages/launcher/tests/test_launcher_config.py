"""Tier 0: the typed config: sources, precedence, round trips and one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.launcher.config import Config, ParallelConfig, TrainConfig
from tessera.launcher.config.config_io import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    resolve_config,
)


def test_defaults_are_valid() -> None:
    assert Config().validate() == []
    assert resolve_config(env={}) == Config()


@given(
    dp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 4]),
    steps=st.integers(1, 10_000),
    lr=st.floats(1e-6, 1.0),
    sp_flag=st.booleans(),
    name=st.text(alphabet="abc_-", max_size=8),
)
def test_toml_round_trip(
    tmp_path_factory: pytest.TempPathFactory,
    dp: int,
    tp: int,
    steps: int,
    lr: float,
    sp_flag: bool,
    name: str,
) -> None:
    config = dataclasses.replace(
        Config(),
        parallel=ParallelConfig(dp=dp, tp=tp, sequence_parallel=sp_flag, microbatches=4),
        train=TrainConfig(steps=steps, name=name),
    )
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=lr))
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=16 * dp))
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(config_to_toml(config))
    assert resolve_config(path, env={}) == config
    assert config_from_dict(config_to_dict(config)) == config


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[train]\nsteps = 5\nseed = 1\n[parallel]\ntp = 2\n")
    env = {"TESSERA_TRAIN_SEED": "2", "TESSERA_TRAIN_LOG_EVERY": "3", "UNRELATED": "x"}
    config = resolve_config(path, ["train.log_every=7", "parallel.sequence_parallel=true"], env=env)
    assert (config.train.steps, config.train.seed, config.train.log_every) == (5, 2, 7)
    assert config.parallel.tp == 2 and config.parallel.sequence_parallel is True


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["parallel.tp=3"], "model.n_heads=4 does not split 3 ways (parallel.tp=3)"),
        (["parallel.dp=0"], "parallel.dp must be >= 1, got 0"),
        (
            ["parallel.dp=3"],
            "data.batch_size=16 is not divisible by parallel.dp * parallel.microbatches = 3 * 4",
        ),
        (["parallel.schedule=zbx"], "parallel.schedule='zbx' is not one of"),
        (["parallel.schedule=zbv"], "zbv always places 2 chunk(s) per rank; got v=1"),
        (
            [
                "parallel.pp=2",
                "parallel.virtual_stages=2",
                "parallel.schedule=interleaved-1f1b",
                "parallel.microbatches=3",
                "data.batch_size=12",
            ],
            "parallel (pp=2, microbatches=3): ",
        ),
        (
            ["parallel.pp=4", "parallel.virtual_stages=2", "parallel.schedule=interleaved-1f1b"],
            "model.n_layers=4 gives 6 blocks (with embedding and head), fewer than parallel.pp * "
            "parallel.virtual_stages = 4 * 2",
        ),
        (["zero.stage=4"], "zero.stage=4 must be 0, 1, 2 or 3"),
        (["train.precision=fp8"], "train.precision='fp8' is not one of fp32, bf16, fp16"),
        (["parallel.cp=2", "parallel.cp_mode=tree"], "parallel.cp_mode='tree' is not one of ring, ulysses"),
        (["train.steps=ten"], "--set: train.steps='ten' is not a valid int"),
        (["parallel.sequence_parallel=maybe"], "is not a boolean"),
        (["train.stepz=1"], "--set: unknown field train.stepz"),
        (["trian.steps=1"], "--set: unknown section [trian]"),
        (["steps=1"], "expected section.field=value"),
    ],
)
def test_each_mistake_is_one_line_naming_the_numbers(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, sets, env={})
    assert any(message in line for line in info.value.lines), info.value.lines
    assert all("\n" not in line for line in info.value.lines)


def test_several_mistakes_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, ["parallel.tp=3", "zero.stage=7", "train.precision=x"], env={})
    assert len(info.value.lines) == 4  # tp=3 breaks both the heads and the MLP width


def test_bad_files_and_types(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(tmp_path / "missing.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve_config(bad, env={})
    typed = tmp_path / "typed.toml"
    typed.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match=r"train.steps='many' must be of type int, not str"):
        resolve_config(typed, env={})


def test_workers_read_the_resolved_config(tmp_path: Path) -> None:
    import json

    config = resolve_config(None, ["train.steps=9"], env={})
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(config_to_dict(config)))
    assert load_config({"TESSERA_RESOLVED_CONFIG": str(path), "TESSERA_TRAIN_STEPS": "1"}).train.steps == 9
    assert load_config({"TESSERA_TRAIN_STEPS": "3"}).train.steps == 3


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [("TESSERA_POLL_WAIT_MS", v, "-3") for v in ("auto", "0", "5", "12.5")]
    + [("TESSERA_SHM", v, "yes") for v in ("auto", "0", "1", "off", "ON")],
)
def test_a_package_variable_is_no_config_field_but_is_checked(name: str, good: str, bad: str) -> None:
    """TESSERA_POLL_WAIT_MS (tessera.comm.waiting) and TESSERA_SHM (tessera.comm.shm) pass
    the unknown-variable check when their values parse, and are refused by name before
    spawning when they do not."""
    assert resolve_config(None, [], env={name: good}) == resolve_config(None, [], env={})
    with pytest.raises(ConfigError, match=f"{name}='{bad}'"):
        resolve_config(None, [], env={name: bad})


def test_split_tuning_does_not_shape_a_checkpoint() -> None:
    """``parallel.tune_splits`` orders the halves of each backward, not what is saved: a resume
    may change it, and a checkpoint written before the field existed still matches."""
    from tessera.launcher.checkpoint.engine_io import _differences, _fingerprint

    base = Config(parallel=ParallelConfig(pp=2, schedule="zb-h1"))
    other = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tune_splits=0))
    assert _differences(_fingerprint(base), _fingerprint(other)) == []
    older = _fingerprint(base)
    assert "tune_splits" not in older["parallel"]
    changed = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, schedule="1f1b"))
    assert _differences(older, _fingerprint(changed)) == ["parallel.schedule: saved 'zb-h1', now '1f1b'"]
