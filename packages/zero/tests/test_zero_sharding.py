"""Tier 1: parameters sharded over their own group (``sharding=``), as expert parameters are
over the expert-data-parallel group, against the formula computed in one thread.

``W`` ranks; ``ep`` consecutive ranks form an expert-parallel group, the ranks ``p, p + ep,
...`` an expert-data-parallel one. Every rank holds the same dense layer and the bank of
its place ``p`` (a different tensor per place, same name). The step the optimizer takes:
the dense gradient averaged over all ``W`` ranks, the bank's summed over its group and
divided by ``W``; the global norm counts the dense gradient once and each place's bank
gradient once; clipping scales all of them. SGD with momentum, two steps, a third after a
save and load that must reproduce the uninterrupted run bit for bit.

Tolerance: 1e-6 absolute and relative on the weights, as ``test_zero_threaded`` (the
ranks' sums run in another order than the formula's; two steps of SGD keep that within
round-off: measured spread of two orders there 6e-8). The resume is compared exactly.
A property test checks how the flat buffers split: every parameter in exactly one, each of
one optimizer group and one process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer

D = 5
LR, MOMENTUM, CLIP = 0.1, 0.9, 0.05  # the clip is below the gradient norm: it scales every step
TOL = {"atol": 1e-6, "rtol": 1e-6}


class Block(nn.Module):
    def __init__(self, place: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.dense = nn.Linear(D, D, bias=True)
        with torch.no_grad():
            self.dense.weight.copy_(torch.randn(D, D, generator=gen) * 0.3)
            self.dense.bias.copy_(torch.randn(D, generator=gen) * 0.1)
        gen = torch.Generator().manual_seed(100 + place)
        self.bank = nn.Parameter(torch.randn(D, D, generator=gen) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x)) @ self.bank


def batch(rank: int, step: int) -> Tensor:
    return torch.randn(3 + rank % 2, D, generator=torch.Generator().manual_seed(1000 * step + rank))


def loss_of(model: Block, x: Tensor) -> Tensor:
    return model(x).square().mean()


def reference(world: int, ep: int, steps: int, frozen_bank: bool = False) -> list[dict[str, Tensor]]:
    """Per place, the weights after ``steps`` steps, by the formula of the module docstring
    (``frozen_bank``: the banks take no gradient and count in no norm)."""
    models = [Block(p) for p in range(ep)]
    dense = dict(models[0].dense.named_parameters())
    for m in models[1:]:  # one dense layer shared by every place
        m.dense = models[0].dense
    params = [*dense.values(), *([] if frozen_bank else [m.bank for m in models])]
    for m in models if frozen_bank else []:
        m.bank.requires_grad_(False)
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            (loss_of(models[rank % ep], batch(rank, step)) / world).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _rank(rank: int, world: int, ep: int, stage: int, root: str, frozen_bank: bool = False) -> dict[str, Any]:
    edp = [dist.new_group(list(range(p, world, ep))) for p in range(ep)][rank % ep]

    def build(at: int = stage) -> tuple[Block, ZeroOptimizer]:
        model = Block(rank % ep)
        model.bank.requires_grad_(not frozen_bank)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        zero = ZeroOptimizer(
            model, opt, stage=at, clip_grad_norm=CLIP, bucket_bytes=64, sharding={model.bank: edp}
        )
        return model, zero

    def step(model: Block, zero: ZeroOptimizer, i: int) -> None:
        zero.backward(loss_of(model, batch(rank, i)))
        assert zero.step()

    def weights(model: Block, zero: ZeroOptimizer) -> dict[str, Tensor]:
        with zero.gathered():
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    model, zero = build()
    step(model, zero, 0)
    zero.save(Path(root) / "ckpt")
    step(model, zero, 1)
    after_two = weights(model, zero)
    step(model, zero, 2)
    after_three = weights(model, zero)
    again, resumed = build()
    resumed.load(Path(root) / "ckpt")
    step(again, resumed, 1)
    step(again, resumed, 2)
    # the full state (each bank whole over its own group) loads into a fresh optimizer at
    # another stage, which then steps as the resumed one does
    resumed_weights = weights(again, resumed)
    full = resumed.full_state()
    layout = [key for key, _ in resumed.full_state_layout()]
    other, moved = build(3 - stage if stage in (0, 3) else 3)
    moved.load_full_state(full, resumed.steps)
    step(again, resumed, 3)
    step(other, moved, 3)
    return {
        "two": after_two,
        "three": after_three,
        "resumed": resumed_weights,
        "full": (layout, sorted(full)),
        "moved": (weights(again, resumed), weights(other, moved)),
    }


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_groups_step_the_mean_loss(world: int, ep: int, stage: int, tmp_path: Path) -> None:
    want = reference(world, ep, 2)
    runs = run_threaded(world, _rank, world, ep, stage, str(tmp_path), timeout=60)
    for rank, run in enumerate(runs):
        for name, got in run["two"].items():
            torch.testing.assert_close(
                got, want[rank % ep][name], **TOL, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
        for name, got in run["resumed"].items():
            assert torch.equal(got, run["three"][name]), f"rank {rank} {name}: the resume differs"
        layout, keys = run["full"]
        assert sorted(layout) == keys and {"param/bank", "param/dense.weight"} <= set(keys), keys
        mine, moved = run["moved"]  # another stage sums in another order: the weights' tolerance
        for name, got in moved.items():
            torch.testing.assert_close(
                got,
                mine[name],
                **TOL,
                msg=lambda m, n=name, r=rank: f"rank {r} {n} after the full state: {m}",
            )


def test_sharding_with_chunks_is_refused() -> None:
    from tessera.zero import ChunkConfig

    def rank_fn(rank: int) -> str:
        model = Block(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        try:
            ZeroOptimizer(model, opt, stage=1, sharding={model.bank: None}, memory=ChunkConfig())
        except ValueError as e:
            return str(e)
        return ""

    assert "with memory=ChunkConfig() is not built" in run_threaded(1, rank_fn)[0]


def _layout(
    rank: int, sizes: list[int], groups: list[int], expert: list[bool], stage: int, bucket: int
) -> Any:
    other = dist.new_group([0])  # a second group object (same rank): the flats must not mix them
    model = nn.ModuleList(nn.Linear(n, 1, bias=False) for n in sizes)
    params = [m.weight for m in model]
    opt_groups = [
        {"params": [p for p, g in zip(params, groups, strict=True) if g == gi]} for gi in sorted(set(groups))
    ]
    opt = torch.optim.SGD(opt_groups, lr=LR)
    gi_of = {id(p): i for i, g in enumerate(opt_groups) for p in g["params"]}
    sharding = {p: other for p, e in zip(params, expert, strict=True) if e}
    zero = ZeroOptimizer(model, opt, stage=stage, bucket_bytes=bucket, sharding=sharding)
    seen = [id(p) for f in zero.flats for p in f.params]
    assert sorted(seen) == sorted(id(p) for p in params), "every parameter in exactly one flat"
    for f in zero.flats:
        assert {gi_of[id(p)] for p in f.params} == {f.group_index}, f
        want = {other if p in sharding else None for p in f.params}
        assert len(want) == 1 and f.group is want.pop(), f  # one process group per flat, the right one
    return len(zero.flats)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 2), st.booleans()), min_size=1, max_size=8),
    st.integers(0, 3),
    st.sampled_from([16, 64, 4096]),
)
def test_each_flat_holds_one_optimizer_group_of_one_process_group(
    specs: list[tuple[int, int, bool]], stage: int, bucket: int
) -> None:
    sizes, groups, expert = (list(x) for x in zip(*specs, strict=True))
    run_threaded(1, _layout, sizes, groups, expert, stage, bucket)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_bank_sharded_over_its_own_group_counts_in_no_norm(stage: int, tmp_path: Path) -> None:
    """The banks frozen (as a fine-tuning run leaves experts): the dense layer steps as the
    formula says with the norm over it alone (at stage 0 too, where only the frozen banks lie
    in other groups than the data-parallel one, so every stepped gradient is whole on each
    rank), and the banks stay as they were."""
    world, ep = 4, 2
    want = reference(world, ep, 2, frozen_bank=True)
    runs = run_threaded(world, _rank, world, ep, stage, str(tmp_path), True, timeout=60)
    for rank, run in enumerate(runs):
        for name, got in run["two"].items():
            torch.testing.assert_close(
                got, want[rank % ep][name], **TOL, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
        assert torch.equal(run["three"]["bank"], Block(rank % ep).bank.detach())
