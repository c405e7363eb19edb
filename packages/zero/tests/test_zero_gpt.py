"""Tier 2: plain data parallelism (stage 0) and ZeRO 1-3 on the reference GPT in gloo worker
processes (world 2, 4 and 8), against one process on the same global batch.

Each step's global batch of ``GLOBAL`` sequences is split evenly over the ranks; every rank
trains on its rows with a per-rank mean loss, and the reference on all rows with the mean
loss over them, which has exactly the averaged gradient. So every world size computes the
same function, and runs differ from the reference (and from each other) only in the order
in which round-off accumulates: the gloo ring, torch's collectives and serial sum in
different orders. The GPT has no linear biases: the key projection's bias has an
analytically zero gradient that Adam would turn into noise-sized weight differences.

Tolerances, from the spread between two *serial* runs of the same steps that sum in another
order (the full batch vs per-rank chunks accumulated in reverse or shuffled, worlds 2, 4, 8,
with and without 1-ulp gradient noise; ``python packages/zero/tests/spread.py``):

- losses (``LOSS_TOL``) and the gradient the optimizer steps on, after averaging and
  clipping (``GRAD_TOL``): spread 4.8e-7 (losses near 4) and 1.3e-8, bounds 1e-5 relative
  and 1e-6 absolute. Under AdamW the gradient is compared at the first step (later ones
  inherit the weight spread below); under SGD at every step.
- SGD-with-momentum weights (``SGD_TOL``): spread 6e-8, bound 1e-6.
- AdamW weights: spread 2.5e-6 here, 1.6e-5 between ZeRO and serial on another AMD EPYC
  machine: Adam steps an element by about ``lr`` whatever its gradient's size, so round-off
  in a small gradient can move that element by up to twice Adam's largest step. No
  elementwise bound below that envelope holds on every machine, so AdamW weights get the
  bound derived from the optimizer, ``tessera.comm.testing.assert_adam_close``: every
  element within the envelope, and per tensor a mean distance of at most 1/1000 of the
  farthest a run can travel. A scale error, to which Adam is blind, fails the gradient
  comparison.

``test_tolerances_hold_under_another_reduction_order`` runs one case with the gloo rings
and with torch's own collectives, and at world 2 and 4, and holds them to the same bounds.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.comm import CommMeter, CommOp, gloo_ring
from tessera.comm.testing import assert_adam_close
from tessera.models import GPT, GPTConfig, make_batch
from tessera.zero import ZeroOptimizer

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, bias=False)
GLOBAL = 8  # sequences per step, split over the ranks (1 each at world 8)
STEPS = 10
CLIP = 0.5
BUCKET = 16 * 1024
ADAM_STATE = 8  # bytes per parameter: exp_avg and exp_avg_sq in fp32
LOSS_TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-5}
GRAD_TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-5}
SGD_TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-5}
ADAM_LR = 1e-2


def check_weights(got: dict[str, Tensor], want: dict[str, Tensor], kind: str) -> None:
    """SGD weights to ``SGD_TOL``; AdamW weights by ``assert_adam_close`` (module docstring)."""
    if kind == "sgd":
        torch.testing.assert_close(got, want, **SGD_TOL)
    else:
        assert_adam_close(got, want, lr=ADAM_LR, steps=STEPS)


def _optimizer(model: GPT, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.1)


def _batch(step: int, rank: int = 0, world: int = 1) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s rows of step ``step``'s global batch (two batches alternate: learnable)."""
    idx, tgt = make_batch(CFG, GLOBAL, seed=1000 * (step % 2))
    rows = GLOBAL // world
    return idx[rank * rows : (rank + 1) * rows], tgt[rank * rows : (rank + 1) * rows]


@functools.cache
def serial(kind: str = "adamw") -> tuple[list[float], dict[str, Tensor], list[dict[str, Tensor]]]:
    """Losses, final weights and the (clipped) gradient stepped on at each step."""
    model = GPT(CFG, seed=0)
    opt = _optimizer(model, kind)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model.loss(*_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, grads


def _train(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train ``case`` on this rank (``torch_collectives``: without the gloo rings)."""
    ring = gloo_ring.applies
    if case.get("torch_collectives"):
        gloo_ring.applies = lambda x, group: False
    try:
        return _train_here(rank, case)
    finally:
        gloo_ring.applies = ring


def _train_here(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    model = GPT(CFG, seed=0)
    world = dist.get_world_size()
    zero = ZeroOptimizer(
        model,
        _optimizer(model, case.get("opt", "adamw")),
        stage=case["stage"],
        precision=case.get("precision", "fp32"),
        offload=case.get("offload", False),
        clip_grad_norm=CLIP,
        bucket_bytes=BUCKET,
    )
    overflow_at = case.get("overflow_at", ())
    out: dict[str, Any] = {"loss": [], "stepped": [], "volume": [], "scale": [], "kept": [], "grads": []}
    grad_steps = case.get("grad_steps", ())  # collective all-gathers: kept off the metered last step
    zero.optimizer.register_step_pre_hook(
        lambda *_: out["grads"].append(zero.full_gradients()) if zero.steps in grad_steps else None
    )
    for step in range(STEPS):
        idx, tgt = _batch(step, rank, world)
        before = torch.cat([f.master.detach().flatten() for f in zero.flats]).clone()
        with CommMeter() as meter:
            loss = model.loss(idx, tgt)
            crafted = loss * 1e4 if step in overflow_at and rank == 1 else loss  # fp16 grads overflow
            zero.backward(crafted)
            if step == STEPS - 1:  # optimizer state exists, gradients are reduced
                report = zero.memory()
            out["scale"].append(zero.loss_scale)
            out["stepped"].append(zero.step())
        after = torch.cat([f.master.detach().flatten() for f in zero.flats])
        out["kept"].append(bool(torch.equal(before, after)))
        out["loss"].append(loss.item())
        out["volume"].append(meter.volume_bytes)
        out["by_op"] = meter.by_op()
    out["memory"] = (report.parameters, report.gradients, report.optimizer_state, report.other)
    out["psi"] = sum(f.numel for f in zero.flats)
    out["padded_bytes"] = sum(f.padded_bytes for f in zero.flats)
    out["padded_numel"] = sum(f.layout.padded_numel for f in zero.flats)
    out["n_flats"] = len(zero.flats)
    kept = (zero.model, model.head)  # stage 3 keeps these gathered into backward: gathered once
    out["kept_bytes"] = sum(f.padded_bytes for m, fl in zero.units if m in kept for f in fl)
    full = zero.full_parameters()  # collective: every rank calls it
    out["params"] = full if rank == 0 else None
    out["world"] = world
    return out


def expected_model_state(stage: int, c: int, psi: float, n: int, offload: bool) -> float:
    """Model-state bytes per rank after backward, by the ZeRO formulas for the dtypes in use:
    compute dtype of c bytes, fp32 master (a separate copy with mixed precision or offload),
    Adam's 8 bytes of state; stage 0 (DDP) shards nothing, 1 shards state and master, 2 also
    the gradients, 3 all. Offload keeps an fp32 gradient shard on the host for the optimizer."""
    n = 1 if stage == 0 else n
    master = 4 if (c != 4 or offload) else 0
    params = c * psi if stage < 3 else c * psi / n
    grads = (c * psi if stage <= 1 else 0) + ((4 if offload else c if stage > 1 else 0) * psi / n)
    return params + grads + (master + ADAM_STATE) * psi / n


def check_meters(res: dict[str, Any], stage: int, c: int, offload: bool) -> None:
    n, psi = res["world"], res["psi"]
    params, grads, state, other = res["memory"]
    want = expected_model_state(stage, c, psi, n, offload)
    assert other == 0  # no bucket buffers are held between backward and step
    assert abs(params + grads + state - want) <= 0.02 * want, (params, grads, state, want)
    stepped_volume = res["volume"][-1]
    if stage == 0:  # one all-reduce of the gradients: 2 x the padded bytes, no norm all-reduce
        assert stepped_volume == 2 * res["padded_bytes"]
        assert abs(stepped_volume - 2 * psi * c) <= 2 * (res["padded_numel"] - psi) * c
        assert res["by_op"] == {CommOp.ALL_REDUCE: 2 * res["padded_bytes"]}
        return
    # comm: 2x (3x for stage 3) the padded parameter bytes in the compute dtype, + 32 for the
    # norm; stage 3 less the backward all-gather of the model's own and the last unit's
    # parameters, which stay gathered from forward into backward (keep_for_backward)
    k = 3 if stage == 3 else 2
    kept = res["kept_bytes"] if stage == 3 else 0
    assert 0 < kept < res["padded_bytes"] or stage != 3
    assert stepped_volume == k * res["padded_bytes"] - kept + 32
    assert abs(stepped_volume + kept - k * psi * c) <= k * (res["padded_numel"] - psi) * c + 32
    assert res["by_op"][CommOp.REDUCE_SCATTER] == res["padded_bytes"]
    assert res["by_op"][CommOp.ALL_GATHER] == (k - 1) * res["padded_bytes"] - kept


def mean_losses(results: list[dict[str, Any]]) -> list[float]:
    world = len(results)
    return [sum(r["loss"][s] for r in results) / world for s in range(STEPS)]


def check_equals_serial(results: list[dict[str, Any]], kind: str) -> None:
    """Losses, the stepped gradients captured (``grad_steps``) and the weights against serial,
    as dicts by name so a mismatch report names the parameter (bounds: module docstring)."""
    ref_losses, ref_params, ref_grads = serial(kind)
    torch.testing.assert_close(mean_losses(results), ref_losses, **LOSS_TOL)
    steps = len(results[0]["grads"])
    torch.testing.assert_close(results[0]["grads"], ref_grads[:steps], **GRAD_TOL)
    check_weights(results[0]["params"], ref_params, kind)
    assert all(all(r["stepped"]) for r in results)


@pytest.mark.parametrize(
    ("stage", "world", "offload"),
    [(s, w, o) for s in (0, 1, 2, 3) for w in (2, 4) for o in (False, True)]
    + [(s, 8, False) for s in (0, 1, 2, 3)],
    ids=lambda v: str(v) if not isinstance(v, bool) else ("offload" if v else ""),
)
def test_gpt_adamw_clipped_equals_serial(worker_pools: Any, stage: int, world: int, offload: bool) -> None:
    """AdamW with clipping, 10 steps: losses and the first stepped gradient to 1e-6, weights
    by the bound derived from AdamW (see the module docstring); meters as theory."""
    case = {"stage": stage, "offload": offload, "grad_steps": (0,)}
    results = worker_pools(world).run(_train, case)
    check_equals_serial(results, "adamw")
    for r in results:
        check_meters(r, stage, 4, offload)


@pytest.mark.parametrize(("stage", "world"), [(0, 4), (1, 4), (2, 8), (3, 4)])
def test_gpt_sgd_momentum_clipped_equals_serial(worker_pools: Any, stage: int, world: int) -> None:
    """SGD with momentum and clipping, 10 steps: losses, the stepped gradient at every step
    and the weights to 1e-6 (serial-vs-serial spread 6e-8: SGD does not amplify round-off)."""
    results = worker_pools(world).run(_train, {"stage": stage, "opt": "sgd", "grad_steps": range(STEPS)})
    check_equals_serial(results, "sgd")


@pytest.mark.parametrize("stage", [2, 3])
def test_tolerances_hold_under_another_reduction_order(worker_pools: Any, stage: int) -> None:
    """The same case with the gloo rings and with torch's own collectives (which sum in
    another order), and at world 2 and 4, meets the same bounds against serial and against
    each other; the ring and torch runs end within the AdamW bound of each other."""
    case = {"stage": stage, "grad_steps": (0,)}
    ring4 = worker_pools(4).run(_train, case)
    torch4 = worker_pools(4).run(_train, case | {"torch_collectives": True})
    ring2 = worker_pools(2).run(_train, case)
    for results in (ring4, torch4, ring2):
        check_equals_serial(results, "adamw")
    for a, b in ((ring4, torch4), (ring4, ring2)):
        torch.testing.assert_close(mean_losses(a), mean_losses(b), **LOSS_TOL)
        torch.testing.assert_close(a[0]["grads"], b[0]["grads"], **GRAD_TOL)
        check_weights(a[0]["params"], b[0]["params"], "adamw")


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "bf16"), (1, "bf16"), (2, "fp16"), (3, "bf16"), (3, "fp16")]
)
def test_gpt_low_precision_follows_fp32(worker_pools: Any, stage: int, precision: str) -> None:
    results = worker_pools(2).run(_train, {"stage": stage, "precision": precision, "offload": stage == 2})
    ref_losses, _, _ = serial()
    losses = mean_losses(results)
    tol = 0.05 if precision == "bf16" else 0.01  # bf16 keeps 8 significant bits: 0.03 at a loss of 4
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < tol, (losses, ref_losses)
    assert losses[-1] < losses[0] - 0.5  # it learns
    for r in results:
        assert all(r["stepped"])
        check_meters(r, stage, 2, stage == 2)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_fp16_overflow_on_one_rank_skips_exactly_those_steps(worker_pools: Any, stage: int) -> None:
    crafted = (2, 6, 7)
    results = worker_pools(2).run(_train, {"stage": stage, "precision": "fp16", "overflow_at": crafted})
    want = [s not in crafted for s in range(STEPS)]
    for r in results:
        assert r["stepped"] == want and r["kept"] == [not w for w in want]
        scale = r["scale"]
        for s in range(1, STEPS):
            assert scale[s] == scale[s - 1] * (0.5 if s - 1 in crafted else 1.0)
