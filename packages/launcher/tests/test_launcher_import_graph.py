"""Tier 0: tessera.launcher's modules import each other without a cycle (counting imports
under TYPE_CHECKING and inside functions)."""

from __future__ import annotations

from tessera.comm.testing.imports import assert_no_import_cycles


def test_tessera_launcher_has_no_import_cycle() -> None:
    assert_no_import_cycles("tessera.launcher")


SUBPACKAGES = ("config", "families", "train", "checkpoint", "run", "data", "job")


def test_the_main_job_uses_the_public_api_only() -> None:
    """The main job (``tessera.launcher.job``) is an application of the launcher: it imports the
    launcher's package roots (``tessera.launcher``, ``tessera.launcher.<concern>``) and its own
    modules, never another concern's inner module."""
    import ast
    import importlib
    from pathlib import Path

    job = Path(importlib.import_module("tessera.launcher.job").__file__ or "").parent
    inner = []
    for path in sorted(job.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("tessera.launcher")
            ):
                parts = node.module.split(".")
                if len(parts) > 3 and parts[2] != "job":
                    inner.append(f"{path.name}: from {node.module} import ...")
    assert not inner, inner


def test_each_concern_exports_what_it_names_from_its_root() -> None:
    import importlib
    import types

    for name in SUBPACKAGES:
        package = importlib.import_module(f"tessera.launcher.{name}")
        for exported in getattr(package, "__all__", ()):
            value = getattr(package, exported)
            assert not isinstance(value, types.ModuleType), (name, exported, value)
