"""Hypothesis strategies shared by the planner's property tests.

A module of the package rather than of ``tests/``: pytest imports test files with
``--import-mode=importlib``, which puts no test folder on ``sys.path``, so one test file
cannot import a sibling. Needs ``hypothesis`` (the ``test`` extra); nothing in the planner
imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tessera.planner.layout import Job
from tessera.planner.model import ModelShape

__all__ = ["jobs"]

_ON = st.just(True)


@st.composite
def jobs(
    draw: st.DrawFn,
    *,
    batch: int,
    precisions: Sequence[str] = ("fp32", "bf16"),
    optimizers: Sequence[str] = ("adamw", "sgd"),
    flash_attention: st.SearchStrategy[bool] = _ON,
) -> Job:
    """A small GPT job with a global batch of ``batch`` sequences: 2 to 8 layers, width 32 to
    128 in 4 heads, a vocabulary of 64 to 4000, sequences of 16 or 32, a precision of
    ``precisions`` and an optimizer of ``optimizers``; ``flash_attention`` (default: on, as
    `ModelShape`'s) draws whether attention keeps its probabilities."""
    model = ModelShape(
        layers=draw(st.integers(2, 8)),
        hidden=draw(st.sampled_from([32, 64, 128])),
        heads=4,
        vocab=draw(st.sampled_from([64, 500, 4000])),
        seq=draw(st.sampled_from([16, 32])),
        batch=batch,
        flash_attention=draw(flash_attention),
    )
    return Job(model, draw(st.sampled_from(precisions)), draw(st.sampled_from(optimizers)))
