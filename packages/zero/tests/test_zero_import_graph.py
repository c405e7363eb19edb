"""Tier 0: tessera.zero's modules import each other without a cycle (counting imports under
TYPE_CHECKING and inside functions), and none reaches into another object's private members."""

from __future__ import annotations

import ast
from pathlib import Path

import tessera.zero
from tessera.comm.testing.imports import assert_no_import_cycles

SOURCE = Path(tessera.zero.__file__).parent


def test_tessera_zero_has_no_import_cycle() -> None:
    assert_no_import_cycles("tessera.zero")


def test_no_module_touches_private_members_of_other_objects() -> None:
    """``x._name`` is allowed on ``self``/``cls`` and on imported third-party modules only."""
    found = []
    for path in sorted(SOURCE.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *modules})
            ):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert found == []
