"""Tier 0: no import cycle between the modules of tessera.comm, and the helper that says so.

The helper (``tessera.comm.testing.imports``) reads source with ``ast``; it is checked here on
tiny synthetic packages written to a temp dir, so a helper that found nothing could not pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.comm.testing import assert_no_import_cycles
from tessera.comm.testing.imports import find_cycles, import_graph


def _package(root: Path, files: dict[str, str], name: str = "pkg") -> Path:
    """Write ``{relative path: source}`` under ``root / name`` and return that directory."""
    for rel, source in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / name


def test_tessera_comm_has_no_import_cycle() -> None:
    assert_no_import_cycles("tessera.comm")


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "from pkg.a import f\nfrom . import sub\n",
            "a.py": "import pkg.b\nfrom pkg import c\nimport os\n",
            "b.py": "def g():\n    from .sub import d\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.d import X\n",
            "sub/__init__.py": "from .. import a\nfrom .d import X\n",
            "sub/d.py": "from ..c import Y\nfrom pkg import sub\nfrom pkg import nothing\n",
        },
    )
    assert import_graph(pkg, "pkg") == {
        "pkg": {"pkg.a", "pkg.sub"},
        "pkg.a": {"pkg.b", "pkg.c"},  # `from pkg import c` is the submodule c; os is not ours
        "pkg.b": {"pkg.sub.d"},  # function level, relative
        "pkg.c": {"pkg.sub.d"},  # under TYPE_CHECKING
        "pkg.sub": {"pkg.a", "pkg.sub.d"},
        "pkg.sub.d": {"pkg.c", "pkg.sub", "pkg"},  # `from pkg import nothing`: pkg's __init__
    }


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.b import g\n",
            "b.py": "def g():\n    from pkg import a\n    return a\n",
            "c.py": "from pkg import a\n",
        },
    )
    graph = import_graph(pkg, "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]
    pkg.joinpath("b.py").write_text("def g():\n    return 1\n")
    assert find_cycles(import_graph(pkg, "pkg")) == []


def test_find_cycles_gives_one_shortest_cycle_per_tangle() -> None:
    graph = {
        "a": {"b"}, "b": {"c", "a"}, "c": {"a"},  # two cycles through a; the shorter is given
        "d": {"d"},  # a module importing itself
        "e": {"f"}, "f": set(),
    }  # fmt: skip
    assert find_cycles(graph) == [["a", "b"], ["d"]]


def test_assert_names_the_cycle_and_its_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "tessera_cycle_probe"  # found on sys.path like any package, never imported
    files = {
        "__init__.py": "",
        "a.py": f"import os\nfrom {name}.b import g\n",
        "b.py": f"def g():\n    import {name}.a\n",
    }
    _package(tmp_path, files, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AssertionError, match=rf"{name}\.a \(line 2\) -> {name}\.b \(line 2\) -> {name}\.a$"):
        assert_no_import_cycles(name)
    with pytest.raises(AssertionError, match="'tessera_no_such_package' is not an importable package"):
        assert_no_import_cycles("tessera_no_such_package")
