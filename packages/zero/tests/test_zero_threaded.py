"""Tier 1: ZeRO logic with ranks as threads, against one process on the concatenated batch.

A small MLP (several parameter groups, tied weights, unused parameters) keeps every example
to milliseconds, so hypothesis can draw world sizes, stages (0 is plain data parallelism),
bucket sizes and optimizers. The reference takes the same mean loss over the concatenation
of every rank's batch, so the two differ only in summation order.

Tolerances (``GRAD_TOL``, ``SGD_TOL``, ``assert_adam_close``), from the spread between two *serial*
runs that sum the same batch in another order (full batch vs per-rank chunks accumulated in
reverse; worlds 2-4, with and without groups, clipping and tied weights; measured by
``python packages/zero/tests/spread.py``): gradients 6e-8, SGD-momentum weights 6e-8, but
Adam(W) weights 7.8e-6 after 3 steps, because Adam divides by the root of the second moment
and so turns round-off in near-zero gradients into weight changes of up to a fraction of
``lr`` (1e-2 here). So the gradient the optimizer steps on and SGD weights are compared to
1e-6 (the stepped gradient at every step under SGD, whose weights stay within round-off;
at the first step under Adam, whose later gradients inherit its weight spread), and Adam(W)
weights by the bound derived from the optimizer (``tessera.comm.testing.assert_adam_close``:
within twice Adam's largest step per step elementwise, and per tensor a mean distance of at
most 1/1000 of the farthest a run can travel), since no elementwise bound below that
envelope holds on every machine. A scale error (missed averaging, clipping or unscaling), to which Adam
is blind, fails the gradient comparison.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import CommMeter, CommOp
from tessera.comm.testing import assert_adam_close, run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.flat_param import Residency

D, H = 6, 10


class MLP(nn.Module):
    """in -> [Linear, Tanh, Linear] -> out; ``tie``: both body layers share one weight (its
    owner for stage 3 is then the model itself, the innermost unit enclosing both uses)."""

    def __init__(self, seed: int, *, tie: bool = False, unused: bool = False, frozen: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(D, H)
        self.body = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))
        self.out = nn.Linear(H, D)
        if tie:
            self.body[2].weight = self.body[0].weight  # type: ignore[union-attr]
        self.spare = nn.Linear(2, 2) if unused else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if frozen:  # the first layer, and one bias in the middle (its weight still trains)
            self.inp.requires_grad_(False)
            self.body[2].bias.requires_grad_(False)  # type: ignore[union-attr]

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.body(h))  # type: ignore[no-any-return]


def batch(step: int, rank: int, micro: int = 0, size: int = 3) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(size, D, generator=gen), torch.randn(size, D, generator=gen)


def make_optimizer(
    model: nn.Module, kind: str, groups: bool, trainable_only: bool = False
) -> torch.optim.Optimizer:
    if trainable_only:  # as a fine-tuning script often builds it
        spec: Any = [p for p in model.parameters() if p.requires_grad]
    elif groups:
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        spec: Any = [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]
    else:
        spec = model.parameters()
    if kind == "sgd":
        return torch.optim.SGD(spec, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind == "adam":
        return torch.optim.Adam(spec, lr=0.01, eps=1e-6)
    return torch.optim.AdamW(spec, lr=0.01, weight_decay=0.1, eps=1e-6)


GRAD_TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-5}
SGD_TOL: dict[str, Any] = {"atol": 1e-6, "rtol": 1e-5}


def serial(case: dict[str, Any]) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """The weights after ``steps`` and the gradient stepped on at each step (after clipping)."""
    model = MLP(0, tie=case.get("tie", False), frozen=case.get("frozen", False))
    opt = make_optimizer(model, case["opt"], case["groups"], case.get("trainable_only", False))
    grads = []
    for step in range(case["steps"]):
        parts = [batch(step, r, m) for r in range(case["world"]) for m in range(case.get("micro", 1))]
        xs, ys = zip(*parts, strict=True)
        opt.zero_grad()
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads


def _backward(zero: ZeroOptimizer, loss: Tensor, plain: bool) -> None:
    if plain:
        loss.backward()  # type: ignore[no-untyped-call]
    else:
        zero.backward(loss)


def _train(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    model = MLP(0, tie=case.get("tie", False), frozen=case.get("frozen", False))
    zero = ZeroOptimizer(
        model,
        make_optimizer(model, case["opt"], case["groups"], case.get("trainable_only", False)),
        stage=case["stage"],
        bucket_bytes=case.get("bucket", 25 * 2**20),
        clip_grad_norm=case.get("clip"),
        offload=case.get("offload", False),
        prefetch=case.get("prefetch", True),
        prefetch_depth=case.get("depth", 1),
        keep_for_backward=case.get("keep", True),
        reuse_buffers=case.get("reuse", True),
    )
    micro = case.get("micro", 1)
    plain = case.get("plain_backward", False)  # as a pipeline runtime does (stages 0-1)
    quiet_ops: list[dict[CommOp, int]] = []
    grads: list[dict[str, Tensor]] = []
    zero.optimizer.register_step_pre_hook(lambda *_: grads.append(zero.full_gradients()))
    for step in range(case["steps"]):
        with CommMeter() as quiet, contextlib.nullcontext() if plain else zero.no_sync():
            for m in range(micro - 1):
                x, y = batch(step, rank, m)
                _backward(zero, F.mse_loss(model(x), y) / micro, plain)
        quiet_ops.append(quiet.by_op())
        x, y = batch(step, rank, micro - 1)
        _backward(zero, F.mse_loss(model(x), y) / micro, plain)
        assert zero.step()
    return {"params": zero.full_parameters(), "grads": grads, "quiet": quiet_ops, "flats": len(zero.flats)}


def check(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``case`` on thread ranks and compare with ``serial`` (dicts by name, so a mismatch
    report names the parameter): stepped gradients to ``GRAD_TOL`` (every step under SGD, the
    first under Adam), weights to ``SGD_TOL`` or by ``assert_adam_close`` (module docstring)."""
    results = run_threaded(case["world"], _train, case)
    ref_params, ref_grads = serial(case)
    sgd = case["opt"] == "sgd"
    steps = len(ref_grads) if sgd else 1
    for res in results:
        torch.testing.assert_close(res["grads"][:steps], ref_grads[:steps], **GRAD_TOL)
        if sgd:
            torch.testing.assert_close(res["params"], ref_params, **SGD_TOL)
        else:  # the largest learning rate of the groups
            assert_adam_close(res["params"], ref_params, lr=0.02, steps=len(ref_grads))
    return results


@settings(max_examples=30)
@given(
    st.integers(1, 4),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["sgd", "adam", "adamw"]),
    st.booleans(),
    st.sampled_from([1, 64, 300, 10_000]),
    st.sampled_from([None, 0.5]),
)
def test_stages_equal_serial(
    world: int, stage: int, opt: str, groups: bool, bucket: int, clip: float | None
) -> None:
    case = {"world": world, "stage": stage, "opt": opt, "groups": groups, "bucket": bucket, "clip": clip}
    check(case | {"steps": 3})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_communicates_only_on_the_last_microbatch(stage: int) -> None:
    case = {"world": 2, "stage": stage, "opt": "adamw", "groups": True, "bucket": 200, "micro": 3}
    case["steps"] = 2
    for res in check(case):
        for ops in res["quiet"]:
            assert CommOp.REDUCE_SCATTER not in ops and CommOp.ALL_REDUCE not in ops
            assert set(ops) == ({CommOp.ALL_GATHER} if stage == 3 else set())


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [0, 1])
def test_plain_backward_works_where_the_reduce_waits_for_step(stage: int, opt: str) -> None:
    """A pipeline runtime calls ``loss.backward()`` itself, per microbatch, without
    ``no_sync``: stages 0-1 reduce only at ``step()``, so that equals serial too."""
    case = {"world": 2, "stage": stage, "opt": opt, "groups": True, "bucket": 200, "micro": 3}
    for res in check(case | {"steps": 2, "clip": 0.5, "plain_backward": True}):
        assert all(not ops for ops in res["quiet"])


@settings(max_examples=16)
@given(
    st.integers(1, 3),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["sgd", "adamw"]),
    st.booleans(),
    st.sampled_from([1, 300]),
    st.booleans(),
)
def test_frozen_parameters_stay_as_they_are_and_the_rest_equal_serial(
    world: int, stage: int, opt: str, trainable_only: bool, bucket: int, offload: bool
) -> None:
    """Frozen parameters (the first layer, a bias in the middle; in the optimizer or not) keep
    their values under weight decay and momentum, as a torch optimizer leaves a parameter
    without a gradient; the clipped gradient norm counts only the trained ones, so the
    rest follow the serial run (tolerances: module docstring)."""
    case = {"world": world, "stage": stage, "opt": opt, "groups": False, "bucket": bucket, "clip": 0.5}
    case |= {"frozen": True, "trainable_only": trainable_only, "offload": offload, "steps": 3}
    start = MLP(0, frozen=True)
    for res in check(case):
        for name in ("inp.weight", "inp.bias", "body.2.bias"):
            torch.testing.assert_close(
                res["params"][name], start.get_parameter(name).detach(), rtol=0, atol=0
            )
            assert all(name not in g for g in res["grads"]), f"{name} was stepped on"


def _all_frozen(rank: int, stage: int) -> tuple[bool, bool]:
    """A rank whose parameters are all frozen (a pipeline stage of a frozen backbone): its
    backward reaches only the input, and its step changes nothing."""
    model = MLP(0)
    model.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero = ZeroOptimizer(
        model, torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage, clip_grad_norm=1.0
    )
    x, y = batch(0, rank)
    zero.backward(F.mse_loss(model(x.requires_grad_()), y))
    stepped = zero.step()
    after = zero.full_parameters()
    return stepped, all(torch.equal(after[n], before[n]) for n in before)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_rank_whose_parameters_are_all_frozen_steps_without_changing_them(stage: int) -> None:
    assert run_threaded(2, _all_frozen, stage) == [(True, True), (True, True)]


def _frozen_gathered_at_the_end_of_backward(rank: int, prefetch: bool) -> list[str]:
    """Stage 3 with every unit but ``out`` frozen: the units whose frozen FlatParams are still
    gathered when backward reaches the input (before the end of backward frees everything)."""
    model = MLP(0)
    for unit in (model.inp, model.body[0], model.body[2]):
        unit.requires_grad_(False)
    zero = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, prefetch=prefetch)
    names = {id(f): f.names[0].rsplit(".", 1)[0] for f in zero.flats}
    seen: list[str] = []

    def look(grad: Tensor) -> Tensor:
        seen.extend(names[id(f)] for f in zero.flats if f.frozen and f.residency is Residency.READY)
        return grad

    x, y = batch(0, rank)
    x.requires_grad_()
    x.register_hook(look)
    zero.backward(F.mse_loss(model(x), y))
    assert zero.step()
    return seen


@pytest.mark.parametrize("prefetch", [False, True])
def test_stage3_frees_frozen_units_as_backward_passes_them(prefetch: bool) -> None:
    """A frozen unit has no gradient for the reducer to finish, so nothing freed it until the end
    of backward: a frozen backbone was whole on every rank by then. Now backward frees it on
    reaching the unit before it, and only the first unit's is left when it reaches the input."""
    assert run_threaded(2, _frozen_gathered_at_the_end_of_backward, prefetch) == [["inp"], ["inp"]]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tied_weights_are_sharded_once(stage: int) -> None:
    case = {"world": 3, "stage": stage, "opt": "adamw", "groups": False, "bucket": 100, "tie": True}
    check(case | {"clip": 0.1, "steps": 3})


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize(("prefetch", "depth"), [(True, 1), (True, 3), (False, 1)])
def test_stage3_gather_options_equal_serial(keep: bool, reuse: bool, prefetch: bool, depth: int) -> None:
    """Keeping the model's own and the last unit's parameters gathered into backward,
    reusing freed memory and prefetching (1 or 3 units ahead) change when memory is filled,
    never the values:
    every combination equals serial (tied weights, which the model itself owns; microbatches
    under ``no_sync``, whose backwards each start from a kept unit)."""
    case = {"world": 2, "stage": 3, "opt": "sgd", "groups": True, "tie": True, "micro": 2, "clip": 0.5}
    check(case | {"steps": 3, "keep": keep, "reuse": reuse, "prefetch": prefetch, "depth": depth})


def _residency(rank: int, keep: bool) -> dict[str, Any]:
    model = MLP(0, tie=True)
    zero = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3, keep_for_backward=keep)
    pool = zero.flats[0].pool
    assert pool is not None
    out: dict[str, Any] = {}
    x, y = batch(0, rank)
    with torch.no_grad():
        model(x)
    out["after_eval"] = _gathered_units(zero)
    loss = F.mse_loss(model(x), y)
    out["after_forward"] = _gathered_units(zero)
    zero.backward(loss)
    out["after_backward"] = _gathered_units(zero)
    out["declared"] = len(zero.declared_buffers())
    out["other"] = zero.memory().other
    out["reused"] = pool.reused
    assert zero.step()
    return out


def _gathered_units(zero: ZeroOptimizer) -> list[str]:
    """The names of the units with a FlatParam not free now (the model itself as "model")."""
    names = {id(m): n for n, m in zero.model.named_modules()}
    busy = [m for m, fl in zero.units if any(f.residency is not Residency.FREE for f in fl)]
    return sorted(names[id(m)] or "model" for m in busy)


@pytest.mark.parametrize("keep", [True, False])
def test_stage3_keeps_only_what_backward_needs_first_and_holds_no_spare_memory(keep: bool) -> None:
    """A forward without gradients frees everything; one with gradients keeps the model's own
    parameters (the tied weight) and the last unit's (``out``) gathered for backward, and
    nothing else; after backward nothing is gathered and the pool holds nothing. With them
    kept, the pool has served some gathers or gradient buffers from freed memory (a unit's
    spare waits only for the next request, so whether one is reused depends on the order of
    sizes: here the two body layers are the same size)."""
    for res in run_threaded(2, _residency, keep):
        assert res["after_eval"] == []
        assert res["after_forward"] == (["model", "out"] if keep else [])
        assert res["after_backward"] == []
        assert res["declared"] == 0 and res["other"] == 0
        assert res["reused"] > 0 or not keep


def _unused(rank: int, stage: int) -> list[bool]:
    model = MLP(0, unused=True)
    zero = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, bucket_bytes=64)
    x, y = batch(0, rank)
    zero.backward(F.mse_loss(model(x), y))
    assert zero.step()
    assert model.spare is not None
    fresh = MLP(0, unused=True).spare
    assert fresh is not None
    with zero.gathered():
        pairs = zip(model.spare.parameters(), fresh.parameters(), strict=True)
        return [bool(torch.equal(p, q)) for p, q in pairs]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameters_get_zero_gradients(stage: int) -> None:
    assert run_threaded(2, _unused, stage) == [[True, True]] * 2


def _fresh(tie: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = MLP(0, tie=tie)
    return model, torch.optim.AdamW(model.parameters())


def test_unsupported_layouts_are_refused_before_any_collective() -> None:
    model = MLP(0)
    with pytest.raises(
        ValueError, match=r"2 model parameters are in no optimizer group: out\.weight, out\.b"
    ):
        ZeroOptimizer(model, torch.optim.SGD(list(model.parameters())[:-2], lr=0.1), stage=1)
    model, _ = _fresh()
    stray = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="1 optimizer parameters are not parameters of the model"):
        ZeroOptimizer(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1), stage=1)
    model, _ = _fresh()
    with pytest.raises(ValueError, match="cannot shard LBFGS"):
        ZeroOptimizer(model, torch.optim.LBFGS(model.parameters()), stage=1)
    model, opt = _fresh()
    F.mse_loss(model(torch.ones(1, D)), torch.zeros(1, D)).backward()
    opt.step()
    with pytest.raises(ValueError, match="already holds state for 8 parameters"):
        ZeroOptimizer(model, opt, stage=3)
    model = MLP(0)
    model.out.weight = nn.Parameter(model.inp.weight.data.t())  # a second Parameter on the same storage
    with pytest.raises(ValueError, match=r"'inp\.weight' and 'out\.weight' are distinct Parameters sharing"):
        ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2)
    model, opt = _fresh()
    with pytest.raises(ValueError, match=r"stage must be 0 \(plain data parallelism\), 1, 2 or 3, got -1"):
        ZeroOptimizer(model, opt, stage=-1)


def _nan_on_one_rank(rank: int, stage: int) -> list[tuple[bool, bool]]:
    """Three fp32 steps without clipping; at step 1 rank 1's loss is NaN."""
    model = MLP(0)
    zero = ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, bucket_bytes=64)
    out = []
    for step in range(3):
        before = [f.master.detach().clone() for f in zero.flats]
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        zero.backward(loss * float("nan") if step == 1 and rank == 1 else loss)
        stepped = zero.step()
        kept = all(torch.equal(b, f.master) for b, f in zip(before, zero.flats, strict=True))
        out.append((stepped, kept))
    assert all(bool(torch.isfinite(f.master).all()) for f in zero.flats)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_non_finite_gradient_skips_the_step_on_every_rank_in_fp32(stage: int) -> None:
    """No loss scaler and no clipping: the norm check still runs, so a NaN on one rank skips
    the step everywhere and leaves every weight as it was; the next step goes on."""
    want = [(True, False), (False, True), (True, False)]
    assert run_threaded(2, _nan_on_one_rank, stage) == [want, want]
