"""Tier 0: each package's tests import only what that package declares.

For every ``packages/<name>/tests/*.py``, each imported module (at any depth, including imports
inside functions) must be the package itself, the standard library, a module of the tests
folder, or come from a distribution the package lists in ``dependencies`` or its ``test``
extra. A module of another optional extra (``hf = ["transformers"]``) is allowed only in a
file that calls ``pytest.importorskip("<module>")``, so the test skips when the extra is absent.
Otherwise ``pip install ./packages/<name>[test]`` would fail at collection.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections.abc import Mapping
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml") if (p.parent / "tests").is_dir())


def _dist(requirement: str) -> str:
    """``"tessera-comm>=0.1,<0.2"`` -> ``"tessera-comm"`` (PEP 503 normalized)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert match, f"unreadable requirement {requirement!r}"
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """Top-level module -> the installed distributions providing it (read once: each reading
    walks every installed distribution's file list, tens of milliseconds)."""
    return packages_distributions()


def _dists_of(module: str) -> set[str]:
    """The distributions that may provide a top-level module (``tessera.comm`` -> tessera-comm)."""
    top, _, sub = module.partition(".")
    if top == "tessera":
        return {_dist(f"tessera-{sub.partition('.')[0]}")}
    return {_dist(d) for d in _distributions().get(top, [])} | {_dist(top)}


def imports_of(path: Path) -> dict[str, int]:
    """``{module: first line}``: top-level names, or ``tessera.<package>`` for the namespace."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "tessera":
                names = [f"tessera.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            key = ".".join(parts[:2]) if parts[0] == "tessera" and len(parts) > 1 else parts[0]
            found.setdefault(key, node.lineno)
    return found


def skipped_without(path: Path) -> set[str]:
    """Modules this file hands to ``pytest.importorskip("...")``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            out.add(str(node.args[0].value).split(".")[0])
    return out


def undeclared(package: Path, root: Path = ROOT) -> list[str]:
    project = tomllib.loads((package / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    declared = {_dist(r) for r in [*project.get("dependencies", []), *extras.get("test", [])]}
    optional = {_dist(r) for name, reqs in extras.items() if name != "test" for r in reqs}
    own = _dist(project["name"])
    tests = package / "tests"
    local = {p.stem for p in tests.glob("*.py")} | {p.name for p in tests.iterdir() if p.is_dir()}
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        guarded = skipped_without(path)
        for module, line in sorted(imports_of(path).items()):
            if module in sys.stdlib_module_names or module in local or module == "tessera":
                continue
            dists = _dists_of(module)
            if own in dists or dists & declared:
                continue
            if dists & optional and module.split(".")[0] in guarded:
                continue
            hint = "guard it with pytest.importorskip" if dists & optional else "declare it or move the test"
            where = f"{path.relative_to(root)}:{line}"
            wrong.append(f"{where} imports {module}, which {own} does not declare ({hint})")
    return wrong


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_a_package_tests_import_only_what_it_declares(package: Path) -> None:
    wrong = undeclared(package)
    assert not wrong, "\n".join(wrong)


def test_the_scan_sees_imports(tmp_path: Path) -> None:
    """The check can fail: an undeclared import, an unguarded optional one, a guarded one."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "tessera-demo"\ndependencies = ["torch"]\n'
        '[project.optional-dependencies]\ntest = ["pytest"]\nhf = ["transformers"]\n'
    )
    (tests / "helper.py").write_text("")
    (tests / "test_a.py").write_text(
        "import os, helper, torch\nfrom tessera.demo import x\n"
        "def f():\n    from tessera.models import GPT\n    import transformers\n"
    )
    guarded = "import pytest\nt = pytest.importorskip('transformers')\nimport transformers\n"
    (tests / "test_b.py").write_text(guarded)
    wrong = undeclared(tmp_path, root=tmp_path)
    assert [w.split(" (")[0] for w in wrong] == [
        "tests/test_a.py:4 imports tessera.models, which tessera-demo does not declare",
        "tests/test_a.py:5 imports transformers, which tessera-demo does not declare",
    ]
