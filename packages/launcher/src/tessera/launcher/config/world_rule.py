"""The rule for degrees in a world of a given size, over plain integers (torch-free, imports no
configuration: ``boost_config`` asks it which values a degree may take).

pp, dp, cp and tp multiply to the world size. At most one of them may be -1 (``AUTO``;
``"auto"`` in TOML, the environment and ``--set``): it becomes the world size over the product
of the others. With none at -1 and all of them 1, dp takes the whole world (plain data
parallelism, what torchrun users expect); otherwise the degrees must multiply to the world size
exactly. ``tessera.launcher.config.world`` applies it to a configuration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = [
    "AUTO",
    "AUTO_FIELDS",
    "WORLD_DEGREES",
    "auto_degrees",
    "auto_problems",
    "infer_degrees",
    "world_needed",
]

AUTO = -1  # a degree inferred from the world size
WORLD_DEGREES = ("pp", "dp", "cp", "tp")  # the degrees that multiply to the world size, in rank order
AUTO_FIELDS = frozenset(f"parallel.{name}" for name in WORLD_DEGREES)  # the fields that take -1 / "auto"


def _product(degrees: Mapping[str, int], names: tuple[str, ...]) -> str:
    """``pp*cp*tp = 1*1*4 = 4``."""
    values = "*".join(str(degrees[n]) for n in names)
    return f"{'*'.join(names)} = {values} = {math.prod(degrees[n] for n in names)}"


def auto_degrees(degrees: Mapping[str, int]) -> list[str]:
    """The names among pp, dp, cp and tp whose value is -1 (auto), in that order."""
    return [name for name in WORLD_DEGREES if degrees[name] == AUTO]


def auto_problems(degrees: Mapping[str, int]) -> list[str]:
    """One line when more than one degree is -1 (empty otherwise): which one would the world fill?"""
    autos = auto_degrees(degrees)
    if len(autos) < 2:
        return []
    values = " ".join(f"{name}={degrees[name]}" for name in WORLD_DEGREES)
    return [
        f"parallel: {' and '.join(autos)} are each -1 (auto), but at most one degree may be inferred from "
        f"the world size ({values})"
    ]


def world_needed(degrees: Mapping[str, int]) -> str:
    """The line refusing a degree of -1 where no world size is given (the first such degree)."""
    name = auto_degrees(degrees)[0]
    return (
        f"parallel.{name}: got -1 (auto: inferred from the world size), so give --nproc-per-node "
        "(or a hostfile with slots=)"
    )


def infer_degrees(degrees: Mapping[str, int], world: int) -> dict[str, int]:
    """pp, dp, cp and tp of ``degrees`` for a world of ``world`` processes (module docstring).

    ValueError naming the numbers: a degree neither >= 1 nor -1, more than one -1, a world that
    the other degrees do not divide, or explicit degrees that do not multiply to the world.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    got = {name: degrees[name] for name in WORLD_DEGREES}
    bad = [f"parallel.{n}={v}" for n, v in got.items() if v < 1 and v != AUTO]
    if bad:
        raise ValueError(f"{', '.join(bad)}: a degree must be >= 1, or -1 (auto: from the world size)")
    problems = auto_problems(got)
    if problems:
        raise ValueError(problems[0])
    autos = auto_degrees(got)
    if autos:
        auto = autos[0]
        others = tuple(n for n in WORLD_DEGREES if n != auto)
        rest = math.prod(got[n] for n in others)
        if world % rest:
            raise ValueError(
                f"world size {world} is not divisible by {_product(got, others)}: parallel.{auto}=-1 "
                "(auto) takes the world size over the other degrees"
            )
        return {**got, auto: world // rest}
    total = math.prod(got.values())
    if total == world:
        return got
    if total == 1:  # nothing set: data parallelism over the whole world
        return {**got, "dp": world}
    raise ValueError(
        f"world size {world} != {_product(got, WORLD_DEGREES)} (set one degree to -1, 'auto', to infer "
        "it from the world size)"
    )
