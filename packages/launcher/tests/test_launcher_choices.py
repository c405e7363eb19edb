"""Tier 0: the config's named choices are enums that read and write as their names.

Every choice field (a field whose default is a ``StrEnum`` member) round-trips each of its
values through TOML, the environment, ``--set``, the resolved JSON and a checkpoint's
fingerprint; any other name is refused naming the key, the value and the allowed values, both
when it is read (``config_io``) and when a section is built in Python (``Config.validate()``).
"""

from __future__ import annotations

import dataclasses
import json
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.comm import TPMode
from tessera.launcher.config import (
    Config,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
)
from tessera.launcher.config.choices import LogLevel, OptimName, RecomputePolicy
from tessera.launcher.config.config_io import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    resolve_config,
)
from tessera.tensor_parallel.context import Layout, Mode
from tessera.zero import Precision
from tessera.zero.chunks import ChunkConfig
from tessera.zero.chunks.config import Policy

SECTIONS: dict[str, Any] = {
    "parallel": ParallelConfig,
    "zero": ZeroConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
}
# (section, field, enum): every choice field of the config
CHOICES = [
    (section, f.name, type(f.default))
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if isinstance(f.default, StrEnum)
]


def test_each_choice_is_the_enum_of_the_package_that_owns_it() -> None:
    owners = {(s, n): e for s, n, e in CHOICES}
    assert owners == {
        ("parallel", "tp_mode"): TPMode,
        ("parallel", "cp_mode"): Mode,
        ("parallel", "cp_layout"): Layout,
        ("zero", "policy"): Policy,
        ("optim", "name"): OptimName,
        ("train", "precision"): Precision,
        ("train", "recompute_policy"): RecomputePolicy,
        ("logging", "level"): LogLevel,
    }
    assert TPMode.TWO_D == "2d" and Mode.ULYSSES == "ulysses" and Precision.BF16 == "bf16"


def _valid(section: str, name: str, value: StrEnum) -> Config:
    """A valid config holding ``value``: the few settings a value needs besides itself."""
    config = Config()
    grid = {
        "tp": {"1d": 1, "2d": 4, "2.5d": 8, "3d": 8}.get(value, 1),
        "tp_depth": 2 if value == "2.5d" else 1,
    }
    needs: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
        ("parallel", "tp_mode"): {"parallel": grid, "data": {"batch_size": 64}},
        ("parallel", "cp_mode"): {"parallel": {"cp": 2}},
        ("parallel", "cp_layout"): {"parallel": {"cp": 2}},
        ("zero", "policy"): {"zero": {"host_budget_mb": 64.0}},
        ("train", "recompute_policy"): {"train": {"activation_checkpointing": True}},
    }
    for sec, values in needs.get((section, name), {}).items():
        config = dataclasses.replace(config, **{sec: dataclasses.replace(getattr(config, sec), **values)})
    current = getattr(config, section)
    return dataclasses.replace(config, **{section: dataclasses.replace(current, **{name: value})})


@given(data=st.data())
def test_every_value_round_trips_toml_env_flags_and_json(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    section, name, enum = data.draw(st.sampled_from(CHOICES))
    value = data.draw(st.sampled_from(list(enum)))
    config = _valid(section, name, value)
    assert config.validate() == []
    path = tmp_path_factory.mktemp("cfg") / "c.toml"
    path.write_text(config_to_toml(config))
    loaded = resolve_config(path, env={})
    assert loaded == config and isinstance(getattr(getattr(loaded, section), name), enum)
    plain = config_to_dict(config)
    assert type(plain[section][name]) is str and plain[section][name] == value.value
    assert config_from_dict(json.loads(json.dumps(plain))) == config
    # the text sources: a flag and an environment variable name the value as written
    rest = config_to_dict(config)
    del rest[section][name]  # the value comes from the flag or the variable only
    other = Path(path.parent, "rest.toml")
    other.write_text(
        "".join(
            f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
            for s, values in rest.items()
        )
    )
    assert resolve_config(other, [f"{section}.{name}={value.value}"], env={}) == config
    env = {f"TESSERA_{section.upper()}_{name.upper()}": value.value}
    assert resolve_config(other, env=env) == config


@given(data=st.data())
def test_any_other_name_is_refused_naming_key_value_and_choices(data: st.DataObject) -> None:
    section, name, enum = data.draw(st.sampled_from(CHOICES))
    allowed = {str(v) for v in enum} | ({str(v).upper() for v in enum} if enum is LogLevel else set())
    word = data.draw(st.text(alphabet="abcdefgilmnprstuvz0123456789.-", min_size=1, max_size=10))
    if word in allowed or (enum is LogLevel and word.upper() in LogLevel.__members__):
        return
    choices = ", ".join(enum)
    line = f"{section}.{name}={word!r} is not one of {choices}"
    with pytest.raises(ConfigError) as flag:
        resolve_config(None, [f"{section}.{name}={word}"], env={})
    assert f"--set: {line}" in flag.value.lines, flag.value.lines
    with pytest.raises(ConfigError) as env:
        resolve_config(None, env={f"TESSERA_{section.upper()}_{name.upper()}": word})
    assert f"environment: {line}" in env.value.lines, env.value.lines
    # built in Python: the section keeps the bad name and validate() reports it, one line
    current = getattr(Config(), section)
    config = dataclasses.replace(Config(), **{section: dataclasses.replace(current, **{name: word})})
    assert line in config.validate()


def test_a_toml_choice_of_another_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nprecision = 16\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(path, env={})
    assert info.value.lines == [f"{path}: train.precision=16 is not one of fp32, bf16, fp16"]


def test_a_name_given_in_python_becomes_the_member() -> None:
    parallel = ParallelConfig(tp=4, tp_mode="2d", cp_mode="ulysses", cp_layout="zigzag")  # type: ignore[arg-type]
    assert parallel.tp_mode is TPMode.TWO_D and parallel.cp_mode is Mode.ULYSSES
    assert parallel.cp_layout is Layout.ZIGZAG
    assert LoggingConfig(level="WARNING").level is LogLevel.WARNING  # type: ignore[arg-type]
    assert ChunkConfig(host_budget_mb=1.0, policy="auto").policy is Policy.AUTO  # type: ignore[arg-type]
    assert ParallelConfig(tp_mode="4d").tp_mode == "4d"  # type: ignore[arg-type]  # left for validate


def test_several_mistakes_of_every_source_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, ["parallel.tp_mode=4d", "optim.name=lion", "zero.stage=7"], env={})
    assert info.value.lines == [
        "--set: parallel.tp_mode='4d' is not one of 1d, 2d, 2.5d, 3d",
        "--set: optim.name='lion' is not one of adamw, adam, sgd",
        "zero.stage=7 must be 0, 1, 2 or 3",
    ]


def test_a_checkpoint_fingerprint_written_with_names_matches() -> None:
    """A manifest stores the fingerprint as JSON (names): it compares equal to the members."""
    from tessera.launcher.checkpoint.engine_io import _differences, _fingerprint

    config = _valid("parallel", "tp_mode", TPMode.TWO_D)
    config = dataclasses.replace(config, train=TrainConfig(precision=Precision.BF16))
    saved = json.loads(json.dumps(_fingerprint(config)))
    assert saved["parallel"]["tp_mode"] == "2d" and saved["train"]["precision"] == "bf16"
    assert _differences(saved, _fingerprint(config)) == []
    other = dataclasses.replace(config, train=TrainConfig(precision=Precision.FP16))
    assert [line.split(":")[0] for line in _differences(saved, _fingerprint(other))] == ["train.precision"]


@pytest.mark.parametrize(
    ("mode", "tp", "depth", "blocks"), [("2d", 4, 1, 2), ("2.5d", 8, 2, 4), ("3d", 8, 1, 4)]
)
def test_the_grid_decides_row_blocks_and_width_split(mode: str, tp: int, depth: int, blocks: int) -> None:
    """``ParallelConfig.grid()`` (comm's TPGrid): a microbatch of one row does not split into
    the grid's row blocks, and 3 heads do not split 2 ways (q = 2 in each grid)."""
    parallel = ParallelConfig(tp=tp, tp_mode=TPMode(mode), tp_depth=depth, microbatches=1)
    assert (parallel.grid().row_blocks, parallel.grid().width_split) == (blocks, 2)
    config = dataclasses.replace(Config(), parallel=parallel)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=1))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_heads=3, d_model=48))
    lines = config.validate()
    rows = f"tp_mode {mode} splits each microbatch's 1 rows (data.batch_size / (dp * microbatches))"
    assert f"{rows} into {blocks} blocks: not divisible" in lines, lines
    assert f"model.n_heads=3 does not split 2 ways (parallel.tp={tp})" in lines, lines
