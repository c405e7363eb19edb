"""The names of a job's parallel axes and of the tensor-parallel modes (pure: no torch)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Axis", "TPMode"]


class TPMode(StrEnum):
    """How the tensor-parallel ranks split a layer."""

    ONE_D = "1d"
    TWO_D = "2d"
    TWO_P5_D = "2.5d"
    THREE_D = "3d"


class Axis(StrEnum):
    """Names of the axes whose rank groups a Topology lists."""

    PP = "pp"
    DP = "dp"
    EP = "ep"
    EDP = "edp"
    CP = "cp"
    TP = "tp"
    TP_ROW = "tp_row"
    TP_COL = "tp_col"
    TP_DEP = "tp_dep"
    TP_INPUT = "tp_input"
    TP_WEIGHT = "tp_weight"
    TP_OUTPUT = "tp_output"
