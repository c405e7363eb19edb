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

    @property
    def whole_rows(self) -> bool:
        """Whether every tp rank sees a microbatch's whole rows (1D: only widths split), so that
        keyword inputs, a user's own loss, Megatron's sequence parallelism and context
        parallelism compose with it; the grid modes split the rows too (``TPGrid.row_blocks``)."""
        return self is TPMode.ONE_D


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
