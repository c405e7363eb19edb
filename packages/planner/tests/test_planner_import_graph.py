"""Tier 0: tessera.planner's modules import each other without a cycle (counting imports
under TYPE_CHECKING and inside functions)."""

from __future__ import annotations

from tessera.comm.testing.imports import assert_no_import_cycles


def test_tessera_planner_has_no_import_cycle() -> None:
    assert_no_import_cycles("tessera.planner")
