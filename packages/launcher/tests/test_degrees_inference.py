"""Tier 0: degrees inferred from the world size (``tessera.launcher.config.world_rule``), as plain
``torchrun`` needs them: a degree of -1 ("auto") takes what the others leave, dp fills the world
when nothing is set, and anything else that does not multiply to the world is one line naming
the numbers. Hypothesis draws degrees and worlds (no processes); then the same rule through
TOML, the environment, ``--set``, ``load_config()`` under ``WORLD_SIZE`` and the ``tessera``
command before it spawns (its spawner replaced by a failure).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.launcher.config import Config, ParallelConfig
from tessera.launcher.config.config_io import ConfigError, load_config, resolve_config
from tessera.launcher.config.world import fit_world
from tessera.launcher.config.world_rule import AUTO, WORLD_DEGREES, infer_degrees
from tessera.launcher.run import cli

degree = st.integers(1, 6)
degrees = st.fixed_dictionaries({name: degree for name in WORLD_DEGREES})


@given(degrees, st.sampled_from(WORLD_DEGREES), st.integers(1, 8))
def test_the_auto_degree_takes_what_the_others_leave(d: dict[str, int], auto: str, share: int) -> None:
    rest = math.prod(v for n, v in d.items() if n != auto)
    got = infer_degrees({**d, auto: AUTO}, rest * share)
    assert got == {**d, auto: share}


@given(degrees, st.sampled_from(WORLD_DEGREES), st.integers(1, 200))
def test_a_world_the_others_do_not_divide_is_refused_naming_the_numbers(
    d: dict[str, int], auto: str, world: int
) -> None:
    others = [n for n in WORLD_DEGREES if n != auto]
    rest = math.prod(d[n] for n in others)
    if world % rest == 0:
        assert infer_degrees({**d, auto: AUTO}, world)[auto] == world // rest
        return
    with pytest.raises(ValueError) as info:
        infer_degrees({**d, auto: AUTO}, world)
    numbers = f"{'*'.join(others)} = {'*'.join(str(d[n]) for n in others)} = {rest}"
    assert str(info.value).startswith(f"world size {world} is not divisible by {numbers}: parallel.{auto}=-1")


@given(degrees, st.sets(st.sampled_from(WORLD_DEGREES), min_size=2), st.integers(1, 64))
def test_at_most_one_degree_is_auto(d: dict[str, int], autos: set[str], world: int) -> None:
    given_degrees = {**d, **dict.fromkeys(autos, AUTO)}
    with pytest.raises(ValueError, match="at most one degree may be inferred") as info:
        infer_degrees(given_degrees, world)
    named = " and ".join(n for n in WORLD_DEGREES if n in autos)
    values = " ".join(f"{n}={given_degrees[n]}" for n in WORLD_DEGREES)
    assert str(info.value) == (
        f"parallel: {named} are each -1 (auto), but at most one degree may be inferred from the world "
        f"size ({values})"
    )


@given(st.integers(1, 512))
def test_with_nothing_set_dp_fills_the_world(world: int) -> None:
    assert infer_degrees(dict.fromkeys(WORLD_DEGREES, 1), world) == {"pp": 1, "dp": world, "cp": 1, "tp": 1}


@given(degrees, st.integers(1, 2000))
def test_explicit_degrees_must_multiply_to_the_world(d: dict[str, int], world: int) -> None:
    total = math.prod(d.values())
    if total in (1, world):  # nothing set (dp fills the world), or exactly the world
        assert math.prod(infer_degrees(d, world).values()) == world
        return
    with pytest.raises(ValueError) as info:
        infer_degrees(d, world)
    numbers = "*".join(str(d[n]) for n in WORLD_DEGREES)
    assert str(info.value).startswith(f"world size {world} != pp*dp*cp*tp = {numbers} = {total} (set one")
    assert "\n" not in str(info.value)


@given(st.sampled_from(WORLD_DEGREES), st.integers(-50, 0).filter(lambda v: v != AUTO), st.integers(1, 8))
def test_a_degree_below_one_other_than_auto_is_refused(name: str, value: int, world: int) -> None:
    with pytest.raises(ValueError, match=rf"parallel\.{name}={value}: a degree must be >= 1, or -1"):
        infer_degrees({**dict.fromkeys(WORLD_DEGREES, 1), name: value}, world)


def test_fit_world_keeps_every_other_field() -> None:
    config = Config(parallel=ParallelConfig(tp=2, dp=AUTO, sequence_parallel=True, microbatches=2))
    fitted = fit_world(config, 6)
    assert fitted.parallel == ParallelConfig(tp=2, dp=3, sequence_parallel=True, microbatches=2)
    assert fitted.model == config.model and fitted.train == config.train
    assert fit_world(fitted, 6) is fitted  # nothing to change


def test_auto_in_toml_environment_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[parallel]\ndp = "auto"\ntp = 2\n')
    assert resolve_config(path, env={}).parallel.dp == AUTO
    assert resolve_config(None, ["parallel.pp=AUTO"], env={}).parallel.pp == AUTO
    assert resolve_config(None, env={"TESSERA_PARALLEL_CP": "-1"}).parallel.cp == AUTO
    with pytest.raises(ConfigError) as info:  # only the degrees that make up the world take it
        resolve_config(None, ["parallel.ep=auto", "parallel.microbatches=-1"], env={})
    assert info.value.lines == [
        "--set: parallel.ep='auto' is not a valid int",
        "parallel.microbatches must be >= 1, got -1",
    ]


def test_before_the_world_is_known_each_field_is_checked_alone() -> None:
    assert Config(parallel=ParallelConfig(dp=AUTO, tp=3)).validate() == []  # heads checked at a world
    assert Config(parallel=ParallelConfig(dp=AUTO, tp=AUTO)).validate() == [
        "parallel: dp and tp are each -1 (auto), but at most one degree may be inferred from the world "
        "size (pp=1 dp=-1 cp=1 tp=-1)"
    ]
    assert Config(parallel=ParallelConfig(dp=-2)).validate() == [
        "parallel.dp must be >= 1, got -2 (or -1: inferred from the world size)"
    ]


def test_load_config_under_torchrun_takes_the_world_from_world_size(tmp_path: Path) -> None:
    assert load_config({"WORLD_SIZE": "2"}).parallel.dp == 2  # nothing set: dp fills the world
    assert load_config({}).parallel.dp == 1
    path = tmp_path / "job.toml"
    path.write_text('[parallel]\ndp = "auto"\ntp = 2\n[train]\nsteps = 7\n')
    config = load_config({"WORLD_SIZE": "6", "TESSERA_CONFIG": str(path)})
    assert (config.parallel.dp, config.parallel.tp, config.train.steps) == (3, 2, 7)
    env = {"WORLD_SIZE": "4", "TESSERA_PARALLEL_TP": "auto", "TESSERA_PARALLEL_PP": "2"}
    assert load_config(env).parallel.degree_values()["tp"] == 2
    assert load_config({"TESSERA_PARALLEL_DP": "auto"}).parallel.dp == AUTO  # boost() infers it
    with pytest.raises(ConfigError) as info:
        load_config({"WORLD_SIZE": "3", "TESSERA_PARALLEL_DP": "2"})
    assert info.value.lines == [
        "world size 3 != pp*dp*cp*tp = 1*2*1*1 = 2 (set one degree to -1, 'auto', to infer it from the "
        "world size)"
    ]
    with pytest.raises(ConfigError) as info:  # the rules between fields, at the inferred degrees
        load_config({"WORLD_SIZE": "4", "TESSERA_PARALLEL_DP": "auto", "TESSERA_PARALLEL_EP": "3"})
    assert info.value.lines == [
        "parallel.ep=3 must divide parallel.dp=4 (expert-parallel ranks are dp ranks)"
    ]
    with pytest.raises(ConfigError, match="environment: WORLD_SIZE='two' is not a whole number"):
        load_config({"WORLD_SIZE": "two"})


def _tessera(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    for key in [k for k in os.environ if k.startswith("TESSERA_")]:
        monkeypatch.delenv(key)

    def spawn(*args: object, **kwargs: object) -> int:
        raise AssertionError("spawned")

    monkeypatch.setattr(cli, "spawn", spawn)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_launcher_infers_before_anything_spawns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "j.py").write_text("")
    run = ["run", "--dry-run", "--nproc-per-node"]
    code, out, _ = _tessera(
        [*run, "4", "--set", "parallel.tp=2", "--set", "parallel.dp=auto", "j.py"], monkeypatch, capsys
    )
    assert code == 0 and out.strip().splitlines()[-1].split() == ["3", "0", "3", "0", "1", "0", "1"]
    code, out, _ = _tessera([*run, "2", "j.py"], monkeypatch, capsys)  # nothing set: dp = 2
    assert code == 0 and out.strip().splitlines()[-1].split() == ["1", "0", "1", "0", "1", "0", "0"]
    code, _, err = _tessera(
        [*run, "3", "--set", "parallel.tp=2", "--set", "parallel.dp=-1", "j.py"], monkeypatch, capsys
    )
    assert (code, err.splitlines()) == (
        2,
        [
            "tessera: --nproc-per-node 3 x 1 node(s): world size 3 is not divisible by pp*cp*tp = 1*1*2 = 2: "
            "parallel.dp=-1 (auto) takes the world size over the other degrees"
        ],
    )
    code, _, err = _tessera(["run", "--set", "parallel.dp=auto", "j.py"], monkeypatch, capsys)
    assert (code, err.splitlines()) == (
        2,
        [
            "tessera: parallel.dp: got -1 (auto: inferred from the world size), so give --nproc-per-node "
            "(or a hostfile with slots=)"
        ],
    )
    # the main job's rules at the inferred dp: 16 sequences do not split over dp 3 x 4 microbatches
    code, _, err = _tessera(["train", "--dry-run", "--nproc-per-node", "3"], monkeypatch, capsys)
    assert (code, err.splitlines()) == (
        2,
        ["tessera: data.batch_size=16 is not divisible by parallel.dp * parallel.microbatches = 3 * 4 = 12"],
    )
