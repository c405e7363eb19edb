"""The launcher's own named choices, and how a configuration section turns names into them.

A section field whose default is a ``StrEnum`` member takes one of that enum's values. The
enums are ``StrEnum``: a member equals its name (``OptimName.ADAMW == "adamw"``), so TOML,
the environment, ``--set`` flags and the JSON of a checkpoint's manifest keep plain strings.
``coerce_choices`` (each section's ``__post_init__``) turns a valid name given in Python into
its member and leaves any other value for ``choice_problems`` (``Config.validate()``) to
report, one line naming the field and the allowed values. Importable without torch.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

__all__ = [
    "LogLevel",
    "OptimName",
    "RecomputePolicy",
    "choice_line",
    "choice_of",
    "choice_problems",
    "coerce_choices",
]


class OptimName(StrEnum):
    """The optimizer the main job builds (``optim.name``)."""

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


class RecomputePolicy(StrEnum):
    """What activation checkpointing keeps of a layer (``train.recompute_policy``): only its
    input (``full``), or also its matrix products and attention (``save-matmuls``)."""

    FULL = "full"
    SAVE_MATMULS = "save-matmuls"


class LogLevel(StrEnum):
    """The log level of the ranks (``logging.level``); a name in any case is accepted."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None


def choice_of(enum: type[StrEnum], value: Any) -> StrEnum | None:
    """The member of ``enum`` that ``value`` names, or None."""
    if isinstance(value, enum):
        return value
    if not isinstance(value, str):
        return None
    try:
        return enum(value)
    except ValueError:
        return None


def choice_line(key: str, value: Any, enum: type[StrEnum]) -> str:
    """The one line refusing ``value`` for ``key``, naming the allowed values."""
    shown = str(value) if isinstance(value, StrEnum) else value
    return f"{key}={shown!r} is not one of {', '.join(enum)}"


def _choice_fields(section: Any) -> list[tuple[str, type[StrEnum]]]:
    return [(f.name, type(f.default)) for f in dataclasses.fields(section) if isinstance(f.default, StrEnum)]


def coerce_choices(section: Any) -> None:
    """Replace each valid name in a (frozen) section's choice fields by its enum member."""
    for name, enum in _choice_fields(section):
        member = choice_of(enum, getattr(section, name))
        if member is not None:
            object.__setattr__(section, name, member)


def choice_problems(section: Any, prefix: str) -> list[str]:
    """One line per choice field of ``section`` holding no member of its enum."""
    return [
        choice_line(f"{prefix}.{name}", getattr(section, name), enum)
        for name, enum in _choice_fields(section)
        if not isinstance(getattr(section, name), enum)
    ]
