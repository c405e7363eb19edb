"""Tier 0: the layering of the packages. Each imports only the Tessera packages below it
(models and comm at the bottom, importing no other; tensor_parallel, pipeline, zero and moe
need only comm; the planner comm, pipeline, zero and, for its calibrator, models; the launcher
all of them), in any module, including imports inside functions and under
TYPE_CHECKING; nobody imports the launcher."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ALLOWED = {
    "models": set(),
    "comm": set(),
    "tensor_parallel": {"comm"},
    "pipeline": {"comm"},
    "zero": {"comm"},
    "moe": {"comm"},
    "planner": {"models", "comm", "pipeline", "zero"},
    "launcher": {"models", "comm", "tensor_parallel", "pipeline", "zero", "planner", "moe"},
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    spec = importlib.util.find_spec(f"tessera.{package}")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    imported: set[str] = set()
    reached = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "tessera" and len(parts) > 1 and parts[1] != package:
                    imported.add(parts[1])
                    if parts[1] not in ALLOWED[package]:
                        reached.add(f"{path.name}:{node.lineno} imports {name}")
    assert reached == set()
    assert ALLOWED[package] <= imported  # the scan sees the imports it is meant to check
