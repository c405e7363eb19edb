"""Tier 1: a plan resolved once (``resolve``) is what ``parallelize`` applies, and each mode says
what its ranks train on (``ModeSpec.objective``) instead of callers branching on the mode."""

from __future__ import annotations

import pytest
import torch

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import GPT_PLAN, parallelize, resolve, shard_specs
from tessera.tensor_parallel.modes import registered_modes

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=1, n_heads=4, d_model=16)


def _parallel(rank: int, resolved_for: int | None, sequence_parallel: bool) -> dict[str, object]:
    """Parallelize at tp=2 by GPT_PLAN, resolved first for ``resolved_for`` ranks (None: the plan
    itself, resolved inside ``parallelize``)."""
    mesh = Mesh(Topology(tp=2))
    model = GPT(CFG, seed=1)
    plan = (
        GPT_PLAN
        if resolved_for is None
        else resolve(model, GPT_PLAN, tp=resolved_for, sequence_parallel=sequence_parallel)
    )
    try:
        parallelize(model, plan=plan, mesh=mesh)
    except ValueError as e:
        return {"error": str(e)}
    return {
        "specs": sorted(shard_specs(model)),
        "shapes": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
    }


def test_a_resolved_plan_is_applied_as_the_plan_itself() -> None:
    given, plain = run_threaded(2, _parallel, 2, False), run_threaded(2, _parallel, None, False)
    assert given == plain, (given, plain)


@pytest.mark.parametrize(("tp", "sequence_parallel"), [(4, False), (2, True)])
def test_a_plan_resolved_for_other_degrees_is_refused_naming_both(tp: int, sequence_parallel: bool) -> None:
    for result in run_threaded(2, _parallel, tp, sequence_parallel):
        error = str(result.get("error"))
        assert f"resolved for tp={tp}, sequence_parallel={sequence_parallel}" in error, result
        assert "parallelize got tp=2, sequence_parallel=False" in error, result


def test_every_mode_says_what_its_ranks_train_on() -> None:
    modes = registered_modes()
    assert set(modes) == set(TPMode)
    for mode, spec in modes.items():
        assert callable(spec.objective), mode
        assert spec.whole_rows is (mode is TPMode.ONE_D), mode


def _one_d(rank: int) -> tuple[bool, float]:
    mesh = Mesh(Topology(tp=2))
    mode = registered_modes()[TPMode.ONE_D].objective(mesh)
    x = torch.arange(12).reshape(3, 4)
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0))
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), (x % 10).flatten(), reduction="sum")
    mine = logits.chunk(2, dim=-1)[rank]
    return bool(torch.equal(mode.inputs(x), x)), float(mode.loss(mine, x % 10) - full)


def test_the_1d_objective_keeps_whole_rows_and_its_loss_is_the_serial_sum() -> None:
    for same, gap in run_threaded(2, _one_d):
        assert same
        # fp32 log-sum-exp over 2 vocabulary halves against the serial one: round-off only
        assert abs(gap) < 1e-4, gap
