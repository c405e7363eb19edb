"""Resolve a Config from a TOML file, then the environment, then command-line flags.

Later sources override earlier ones, field by field:

- TOML: ``[parallel]`` ``dp = 2`` and so on, one table per section.
- Environment: ``TESSERA_<SECTION>_<FIELD>``, e.g. ``TESSERA_PARALLEL_DP=2``,
  ``TESSERA_TRAIN_STEPS=50``.
- Flags: ``--set section.field=value`` (repeatable), e.g. ``--set parallel.tp=2``.

The TOML file is the one given (``tessera --config``), else the one ``TESSERA_CONFIG`` names.
A degree (``parallel.dp``, ``pp``, ``tp``, ``cp``) may be ``-1`` or ``"auto"`` in any source:
inferred from the world size (``tessera.launcher.config.world_rule``), which ``load_config()`` takes
from ``WORLD_SIZE`` under plain ``torchrun``.

Unknown sections or fields and values of the wrong type are errors naming the key: in TOML
(and the resolved JSON) a value must have the field's own type (a string is not an int, a
float or a bool is not an int; an int is accepted for a float), while environment and flag
values are text parsed as the field's type. A choice (a field whose default is an enum
member: ``parallel.tp_mode``, ``train.precision``, ...) is given by its name and becomes the
member; any other name is an error naming the key, the value and the allowed names. Every
mistake of every source is reported together with those ``Config.validate()`` finds in the
rest. A tuple field (``zero.fractions``) is an array
of numbers in TOML and comma-separated text (``0,0.5,0.5``) in the environment. Any
``TESSERA_*`` environment variable that is neither a field nor one of ``LAUNCHER_ENV`` (set
by the launcher itself) or ``PACKAGE_ENV`` (read by the packages below, such as
``TESSERA_POLL_WAIT_MS`` of ``tessera.comm.waiting`` and ``TESSERA_SHM`` of
``tessera.comm.shm``, whose values are checked here) is an
error, so a misspelt ``TESSERA_PARALEL_DP=4`` cannot be silently ignored. The resolved config travels
to the workers of ``tessera run`` as a file named by ``TESSERA_RESOLVED_CONFIG``, so every
rank sees exactly what was validated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from tessera.comm import shm_env
from tessera.comm.waiting import ENV as POLL_WAIT_ENV
from tessera.comm.waiting import budget_from_env
from tessera.launcher.config.boost_config import BoostConfig
from tessera.launcher.config.choices import choice_line, choice_of
from tessera.launcher.config.elastic import ELASTIC_ENV, at_world
from tessera.launcher.config.main_config import Config
from tessera.launcher.config.world import fit_world, world_from_env
from tessera.launcher.config.world_rule import AUTO, AUTO_FIELDS

__all__ = [
    "CONFIG_FILE_ENV",
    "HEARTBEAT_ENV",
    "LAUNCHER_ENV",
    "LAUNCHER_PID_ENV",
    "RESOLVED_ENV",
    "RUN_FOLDER_ENV",
    "ConfigError",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "resolve_config",
]

RESOLVED_ENV = "TESSERA_RESOLVED_CONFIG"
RUN_FOLDER_ENV = "TESSERA_RUN_FOLDER"  # the run folder `tessera train` created for this job
HEARTBEAT_ENV = "TESSERA_HEARTBEAT_DIR"  # where each rank's watchdog heartbeat goes
LAUNCHER_PID_ENV = "TESSERA_LAUNCHER_PID"  # workers die with this process
RESTART_ENV = "TESSERA_RESTART_COUNT"  # which attempt of the job this is (0: the first)
CONFIG_FILE_ENV = "TESSERA_CONFIG"  # the TOML file when none is given (plain torchrun, srun)
# TESSERA_* variables that are not configuration fields: the launcher's own, and the
# workspace's hatch environments' (TESSERA_PKG_TESTS names a package's tests).
LAUNCHER_ENV = frozenset(
    {
        RESOLVED_ENV,
        RUN_FOLDER_ENV,
        HEARTBEAT_ENV,
        LAUNCHER_PID_ENV,
        RESTART_ENV,
        ELASTIC_ENV,
        CONFIG_FILE_ENV,
        "TESSERA_PKG_TESTS",
    }
)
# TESSERA_* variables of the packages below, read where they act; checked here before spawning
# (each checker raises ValueError naming the variable)
PACKAGE_ENV: Mapping[str, Callable[[Mapping[str, str]], object]] = {
    POLL_WAIT_ENV: budget_from_env,
    shm_env.ENV: shm_env.enabled_from_env,
}
_PREFIX = "TESSERA_"


class ConfigError(ValueError):
    """A configuration that cannot run; ``lines`` holds one message per mistake."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = list(lines)


def _numbers(key: str, value: Any, *, text: bool) -> tuple[float, ...]:
    """A tuple field (numbers): a TOML array, or comma-separated text from the environment
    or a flag ("" is the empty tuple)."""
    if text and isinstance(value, str):
        items: list[Any] = [w.strip() for w in value.split(",") if w.strip()]
        try:
            return tuple(float(w) for w in items)
        except ValueError:
            raise ConfigError([f"{key}={value!r} is not a comma-separated list of numbers"]) from None
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in value
    ):
        raise ConfigError([f"{key}={value!r} must be an array of numbers"])
    return tuple(float(v) for v in value)


def _convert(key: str, value: Any, default: Any, *, text: bool) -> Any:
    if key in AUTO_FIELDS and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO  # a degree inferred from the world size, in any source
    kind = type(default)
    if isinstance(default, StrEnum):  # a choice: its name, from TOML, the environment or a flag
        name = value.strip() if text and isinstance(value, str) else value
        member = choice_of(kind, name)
        if member is None:
            raise ConfigError([choice_line(key, value, kind)])
        return member
    if kind is tuple:
        return _numbers(key, value, text=text)
    if text and isinstance(value, str) and kind is not str:
        word = value.strip()
        if kind is bool:
            if word.lower() in ("1", "true", "yes", "on"):
                return True
            if word.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError([f"{key}={value!r} is not a boolean (true/false)"])
        try:
            return kind(word)
        except ValueError:
            raise ConfigError([f"{key}={value!r} is not a valid {kind.__name__}"]) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:
        raise ConfigError([f"{key}={value!r} must be of type {kind.__name__}, not {type(value).__name__}"])
    return value


# Keys of earlier versions: refused in one line that names the new key. Context parallelism was
# ``sp``, which read like Megatron's sequence parallelism (``parallel.sequence_parallel``).
RENAMED = {
    "parallel.sp": "parallel.cp (context parallelism)",
    "parallel.sp_mode": "parallel.cp_mode",
    "parallel.sp_layout": "parallel.cp_layout",
}


def _apply(
    config: Config,
    updates: Mapping[str, Mapping[str, Any]],
    source: str,
    errors: list[str],
    *,
    text: bool = False,
) -> Config:
    """``config`` with the values of ``updates`` that convert; a line in ``errors`` for each
    that does not (that field keeps its value)."""
    new_sections: dict[str, Any] = {}
    for section, values in updates.items():
        if not hasattr(config, section) or not dataclasses.is_dataclass(getattr(config, section)):
            known = ", ".join(f.name for f in dataclasses.fields(Config))
            errors.append(f"{source}: unknown section [{section}] (known: {known})")
            continue
        current = getattr(config, section)
        names = {f.name for f in dataclasses.fields(current)}
        changes: dict[str, Any] = {}
        for name, value in values.items():
            key = f"{section}.{name}"
            if key in RENAMED:
                errors.append(f"{source}: {key} is now called {RENAMED[key]}")
                continue
            if name not in names:
                errors.append(f"{source}: unknown field {key} (known: {', '.join(sorted(names))})")
                continue
            try:
                changes[name] = _convert(key, value, getattr(current, name), text=text)
            except ConfigError as exc:
                errors.extend(f"{source}: {line}" for line in exc.lines)
        new_sections[section] = dataclasses.replace(current, **changes)
    return dataclasses.replace(config, **new_sections)


def _from_env(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    sections = [f.name for f in dataclasses.fields(Config)]
    out: dict[str, dict[str, str]] = {}
    unknown = []
    for key, value in env.items():
        if not key.startswith(_PREFIX) or key in LAUNCHER_ENV:
            continue
        if key in PACKAGE_ENV:
            try:
                PACKAGE_ENV[key](env)
            except ValueError as e:
                raise ConfigError([f"environment: {e}"]) from e
            continue
        rest = key[len(_PREFIX) :].lower()
        for section in sections:
            if rest.startswith(section + "_"):
                out.setdefault(section, {})[rest[len(section) + 1 :]] = value
                break
        else:
            unknown.append(key)
    if unknown:
        known = ", ".join(f"TESSERA_{s.upper()}_*" for s in sections)
        raise ConfigError([f"environment: unknown variable {k}={env[k]!r} (known: {known})" for k in unknown])
    return out


def _from_flags(sets: Sequence[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    errors = []
    for item in sets:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            errors.append(f"--set {item!r}: expected section.field=value, e.g. parallel.tp=2")
            continue
        out.setdefault(section, {})[name] = value
    if errors:
        raise ConfigError(errors)
    return out


def _problems(config: Config, main_job: bool) -> list[str]:
    """``validate()`` of the main job's whole `Config`, or ``validate_fields()``: the core's
    rules (`BoostConfig`: what a script's ``boost()`` reads; it checks the script's own model
    itself) and each field of ``[model]`` and ``[data]`` alone."""
    return config.validate() if main_job else config.validate_fields()


def resolve_config(
    path: str | Path | None = None,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    main_job: bool = True,
    world: int | None = None,
) -> Config:
    """Defaults, then the TOML file at ``path`` (None: the one ``TESSERA_CONFIG`` in ``env``
    names, if any), then ``env``, then ``sets``; with ``world``, the degrees inferred for that
    many processes (`tessera.launcher.config.world.fit_world`); validated: for the main job
    (``tessera train``, ``plan``, ``prepare-data``) with its ``[model]`` and ``[data]``, else
    (``main_job=False``: ``tessera run`` of a script) the core sections' rules and each field
    alone (`Config.validate_fields`). While a degree is -1 (no ``world``), the rules between
    fields wait for the world size.

    Raises ConfigError listing every mistake (unknown keys, wrong types, impossible values).
    """
    env = os.environ if env is None else env
    config, errors = Config(), list[str]()
    if path is None and env.get(CONFIG_FILE_ENV):
        path = env[CONFIG_FILE_ENV]
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config file {str(p)!r} does not exist"])
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"{p}: not valid TOML: {exc}"]) from None
        bad = [k for k, v in data.items() if not isinstance(v, dict)]
        if bad:
            raise ConfigError([f"{p}: top-level key {k!r} must be a [section] table" for k in bad])
        config = _apply(config, data, str(p), errors)
    config = _apply(config, _from_env(env), "environment", errors, text=True)
    config = _apply(config, _from_flags(sets), "--set", errors, text=True)
    if world is not None and not errors:
        try:
            config = fit_world(config, world)
        except ValueError as exc:
            errors.append(str(exc))
    errors += _problems(config, main_job)
    if errors:
        raise ConfigError(errors)
    return config


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Inside a worker of ``tessera run``: the resolved config it was started with.

    Outside one (plain ``torchrun``, or ``srun`` with torch's environment): defaults, then the
    TOML file ``TESSERA_CONFIG`` names, then the environment, with the degrees inferred for the
    world ``WORLD_SIZE`` gives (a degree of -1 takes what the others leave; with none set dp
    fills the world); without ``WORLD_SIZE`` a -1 stays for ``boost()`` to infer. Validated as a
    script's (the core sections): the launcher checked the main job's whole before spawning.
    """
    env = os.environ if env is None else env
    resolved = env.get(RESOLVED_ENV)
    if not resolved:
        try:
            world = world_from_env(env)
        except ValueError as exc:
            raise ConfigError([f"environment: {exc}"]) from None
        return resolve_config(None, (), env, main_job=False, world=world)
    config = config_from_dict(json.loads(Path(resolved).read_text()))
    if env.get(ELASTIC_ENV) == "1" and "WORLD_SIZE" in env:  # restarted on fewer nodes: dp follows
        config = at_world(config, int(env["WORLD_SIZE"]))
    return config


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, StrEnum) else value


def config_to_dict(config: BoostConfig) -> dict[str, dict[str, Any]]:
    """The config as plain nested dicts (JSON- and TOML-friendly: a choice is its name)."""
    return {
        f.name: {k: _plain(v) for k, v in dataclasses.asdict(getattr(config, f.name)).items()}
        for f in dataclasses.fields(config)
    }


def config_from_dict(data: Mapping[str, Mapping[str, Any]], *, main_job: bool = False) -> Config:
    """Inverse of config_to_dict (validated as ``resolve_config`` does; by default the core)."""
    errors: list[str] = []
    config = _apply(Config(), data, "resolved config", errors)
    errors += _problems(config, main_job)
    if errors:
        raise ConfigError(errors)
    return config


def config_to_toml(config: BoostConfig) -> str:
    """The config as a TOML document that resolve_config reads back to the same Config."""
    lines: list[str] = []
    for section, values in config_to_dict(config).items():
        lines.append(f"[{section}]")
        for name, value in values.items():
            lines.append(f"{name} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
