"""A model whose parameters are still on the meta device, made by ZeRO one flat buffer at a time.

``ZeroOptimizer(init=value_of)`` takes a model built under ``torch.device("meta")`` and asks
``value_of(param)`` for each parameter while it fills its FlatParams. Oracle: the same model
built eagerly with those values and handed to the same ``ZeroOptimizer`` (stage, world,
precision, chunks). The parameters it then holds and the losses and fp32 masters of three
AdamW steps must be equal exactly (``torch.equal``): the values are copied, not computed,
and both runs then execute the same operations in the same order.

Besides equality, the point of deferring at stage 3: when ``value_of`` is called, the
parameters made before hold no memory (their FlatParams' full buffers are released), so
no rank ever holds the model's values. (The shards left are measured by
``hatch run bench big-model``, not asserted here.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.chunks import ChunkConfig

D, H = 6, 40


class Mixer(nn.Module):
    """A user's block: two projections and a gain that is a bare Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D, bias=False)
        self.gain = nn.Parameter(torch.ones(D))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.gain * self.down(F.gelu(self.up(x)))


class Tower(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Mixer() for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def values(depth: int) -> dict[str, Tensor]:
    """The values both runs use, by parameter name (not those of any init)."""
    gen = torch.Generator().manual_seed(depth)
    shapes = {n: p.shape for n, p in Tower(depth).named_parameters()}
    return {n: torch.randn(shape, generator=gen) * 0.4 for n, shape in shapes.items()}


def train(rank: int, case: dict[str, Any], deferred: bool) -> dict[str, Any]:
    want = values(case["depth"])
    if deferred:
        with torch.device("meta"):
            model = Tower(case["depth"])
    else:
        model = Tower(case["depth"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(want[n])
    name_of = {id(p): n for n, p in model.named_parameters()}
    seen: list[str] = []
    held: list[int] = []  # bytes the parameters made before hold, at each call

    def value_of(param: nn.Parameter) -> Tensor:
        seen.append(name_of[id(param)])
        made = [p.untyped_storage() for p in model.parameters() if not p.is_meta]
        held.append(sum({s.data_ptr(): s.nbytes() for s in made}.values()))
        return want[name_of[id(param)]].double()  # any dtype: ZeRO converts

    memory = None
    if case["disk"]:
        memory = ChunkConfig(
            host_budget_mb=0.01, disk_dir=Path(case["tmp"]) / f"{deferred}-{rank}", chunk_numel=64
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    more: dict[str, Any] = {"init": value_of, "device": torch.device("cpu")} if deferred else {}
    zero = ZeroOptimizer(model, optimizer, stage=case["stage"], bucket_bytes=512, memory=memory, **more)
    with zero.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, D, generator=gen), torch.randn(5, D, generator=gen)
        loss = F.mse_loss(model(x), y)
        zero.backward(loss)
        zero.step()
        losses.append(float(loss.detach()))
    out = {"params": params, "losses": losses, "masters": zero.full_state(), "seen": seen, "held": held}
    zero.close()
    return out


@settings(max_examples=16, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@given(stage=st.integers(0, 3), depth=st.integers(1, 3), world=st.sampled_from([1, 2]), disk=st.booleans())
def test_deferred_equals_eager(
    tmp_path_factory: pytest.TempPathFactory, stage: int, depth: int, world: int, disk: bool
) -> None:
    case = {"stage": stage, "depth": depth, "disk": disk, "tmp": str(tmp_path_factory.mktemp("chunks"))}
    eager = run_threaded(world, train, case, False, timeout=120)
    deferred = run_threaded(world, train, case, True, timeout=120)
    names = [n for n, _ in Tower(depth).named_parameters()]
    for rank, (want, got) in enumerate(zip(eager, deferred, strict=True)):
        assert sorted(got["seen"]) == sorted(names), f"rank {rank}: values asked for {got['seen']}"
        wrong = [n for n in names if not torch.equal(got["params"][n], want["params"][n])]
        assert not wrong, f"rank {rank}, {case}: parameters differ for {wrong}"
        assert got["losses"] == want["losses"], f"rank {rank}, {case}: {got['losses']} != {want['losses']}"
        wrong = [k for k in want["masters"] if not torch.equal(got["masters"][k], want["masters"][k])]
        assert not wrong, f"rank {rank}, {case}: state differs for {wrong}"
        if stage == 3:  # the full buffers of the FlatParams filled before are released
            assert max(got["held"]) == 0, f"rank {rank}: the parameters made held {got['held']} bytes"


def test_refusals_name_what_is_wrong() -> None:
    with torch.device("meta"):
        model = Tower(1)

    def build(**kwargs: Any) -> str:
        try:
            ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=1, **kwargs)
        except ValueError as exc:
            return str(exc)
        return "accepted"

    got = build()
    assert "meta device (stem.weight" in got and "init=" in got, got
    got = build(init=lambda p: torch.zeros(p.shape))
    assert "give ZeroOptimizer(device=...)" in got, got
    got = run_threaded(1, lambda rank: build(init=lambda p: torch.zeros(3), device=torch.device("cpu")))[0]
    assert "the value given has shape (3,)" in got, got


@pytest.mark.parametrize("stage", [0, 3])
def test_a_made_parameter_keeps_its_attributes(stage: int) -> None:
    """The parameter made in place of a meta one is the same Python object and keeps what
    was set on it (tensor parallelism tags a parameter whose gradient is partial over tp)."""

    def build(rank: int) -> list[tuple[bool, object]]:
        with torch.device("meta"):
            model = Tower(1)
        params = list(model.parameters())
        for i, p in enumerate(params):
            p.tag = i  # type: ignore[attr-defined]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        zero = ZeroOptimizer(
            model, optimizer, stage=stage, init=lambda p: torch.zeros(p.shape), device=torch.device("cpu")
        )
        out = [(p is q, getattr(q, "tag", None)) for p, q in zip(params, model.parameters(), strict=True)]
        out.append((not any(q.is_meta for q in model.parameters()), None))
        zero.close()
        return out

    got = run_threaded(1, build)[0]
    assert got == [(True, i) for i in range(len(got) - 1)] + [(True, None)], got
