"""A user's own mixture of experts, under its own names, through ``boost()`` with nothing
converted by hand.

The model is ``tessera.models.foreign_moe.Mixish``: a Llama-style model whose MLPs are a
plain-PyTorch sparse mixture (router ``gate``, an ``nn.ModuleList`` of SwiGLU experts named
``gate_proj`` / ``up_proj`` / ``down_proj``, an optional ``shared_expert``; softmax top-k
looping over the experts) that records its load-balancing loss as ``balance_loss``, summed
by the model's ``aux_loss()``. Its loss function is what a user writes:
``cross_entropy + AUX * model.aux_loss()``, a closure over the model.

Tier 0: ``convert_own_moe`` finds the blocks by their roles, measures which projection is
the gate, whether the router scores by softmax or sigmoid and whether the top-k weights are
renormalised, and the converted model gives the same logits, input gradients and
``aux_loss()`` (also for experts stored stacked with a router nested in a module, and for a
sigmoid router over GELU experts); what it cannot reproduce is refused, naming why.
Tier 2: ``boost()`` converts it itself and trains it at dp2 x ep2 (ZeRO 1, and ZeRO 3
with two microbatches), tp2 (the mixture replicated) and pp2, equal to the serial run of the
model as the user wrote it, which adds the aux loss to each (rank, microbatch) chunk's loss
(the load-balancing loss is a per-call statistic), and the stacked mixture at dp2 x ep2;
``verify=True`` passes; each export carries the user's names and loads strictly into a fresh
copy of the user's model.

Bounds: logits and gradients of the conversion fp32 rtol 1e-5 / atol 1e-6 (the same
products, a per-expert loop against one batched matmul: summation order only). Trained runs:
losses rel 1e-5, weights after 3 SGD steps rtol 1e-5 + atol 1e-6 (SGD is linear in the
gradient, so round-off is not amplified; routers of order 1 keep every choice far from a
tie). A lost expert, a wrong gate/up reading or an aux loss that no longer changes is off
at order 1e-2 or more.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import BoostConfig, ModelSpec, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.own_moe import NamedMoE, convert_own_moe, find_own_moe
from tessera.launcher.testing import RandomTokens, serial_run, sgd
from tessera.models.foreign_moe import MIXISH_ROLES, MixConfig, Mixish

VOCAB, SEQ, BATCH, STEPS, LR, AUX = 64, 8, 8, 3, 0.1, 0.05
TOL = {"rtol": 1e-5, "atol": 1e-6}


TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


# ------------------------------------------------------------------------------------ tier 0
class Stacked(nn.Module):
    """A mixture with its experts stacked as torchtitan's ``GroupedExperts`` store them (``w1``,
    ``w3`` ``[E, h, d]``, ``w2`` ``[E, d, h]``) and its router's ``gate`` inside a ``router``
    module; the same routing and ``balance_loss`` as ``Mixish``'s blocks."""

    def __init__(self, d: int, h: int, experts: int, top_k: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.top_k, self.num_experts = top_k, experts
        self.router = nn.Module()
        self.router.gate = nn.Linear(d, experts, bias=False)
        with torch.no_grad():
            self.router.gate.weight.copy_(torch.randn(experts, d, generator=gen))
        self.w1 = nn.Parameter(torch.randn(experts, h, d, generator=gen) / d**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, h, d, generator=gen) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, d, h, generator=gen) / h**0.5)
        self.balance_loss = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router.gate(tokens).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            rows, slot = torch.where(chosen == e)
            t = tokens[rows]
            y = (F.silu(t @ self.w1[e].t()) * (t @ self.w3[e].t())) @ self.w2[e].t()
            out = out.index_add(0, rows, y * weights[rows, slot][:, None])
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).to(probs.dtype)
        self.balance_loss = self.num_experts * torch.dot(counts / counts.sum(), probs.mean(dim=0))
        return out.view(x.shape)


def _stacked() -> Mixish:
    model = Mixish(MixConfig(), seed=0)
    for i, layer in enumerate(model.layers):
        layer.moe = Stacked(32, 24, 4, 2, seed=7 + i)
    return model


def test_stacked_experts_and_a_nested_router_convert() -> None:
    model = _stacked()
    converted = copy.deepcopy(model)
    conversion = convert_own_moe(converted)
    assert conversion.blocks == ["layers.0.moe", "layers.1.moe"]
    ids = TOKENS.at(0)[0]
    torch.testing.assert_close(converted(ids), model(ids), **TOL)
    torch.testing.assert_close(converted.aux_loss(), model.aux_loss(), **TOL)
    parts = conversion.exported["layers.0.moe.experts.w1"]
    assert [(p.name, p.index, p.transpose) for p in parts] == [("layers.0.moe.w1", None, True)]
    assert conversion.exported["layers.0.moe.router.weight"][0].name == "layers.0.moe.router.gate.weight"


@pytest.mark.parametrize(
    "config",
    [MixConfig(), MixConfig(shared=8), MixConfig(top_k=1, norm_topk=False)],
    ids=["top2", "shared-expert", "top1-unnormalised"],
)
def test_a_converted_model_computes_what_the_users_model_computes(config: MixConfig) -> None:
    model = Mixish(config)
    converted = copy.deepcopy(model)
    conversion = convert_own_moe(converted)
    assert conversion.blocks == ["layers.0.moe", "layers.1.moe"]
    layer = converted.get_submodule("layers.0.moe")
    assert isinstance(layer, NamedMoE) and layer.router.renormalize == config.norm_topk
    assert layer.aliases == {"balance_loss": "aux_loss"} and layer.top_k == config.top_k
    ids = TOKENS.at(0)[0]
    want, got = model(ids), converted(ids)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(converted.aux_loss(), model.aux_loss(), **TOL)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    ((want * g).sum() + model.aux_loss()).backward()
    ((got * g).sum() + converted.aux_loss()).backward()
    ours, theirs = converted.get_submodule("layers.1.moe"), model.get_submodule("layers.1.moe")
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, **TOL)
    torch.testing.assert_close(ours.experts.w1.grad[2], theirs.experts[2].gate_proj.weight.grad.t(), **TOL)
    torch.testing.assert_close(ours.experts.w2.grad[0], theirs.experts[0].down_proj.weight.grad.t(), **TOL)
    torch.testing.assert_close(converted.tok_embeddings.weight.grad, model.tok_embeddings.weight.grad, **TOL)


class _Sigmoid(nn.Module):
    """A mixture whose router scores each expert with a sigmoid (weights unnormalised) and whose
    experts are ``nn.Sequential(Linear, GELU, Linear)``; ``doubled``: its output times 2, which no
    reading reproduces."""

    def __init__(self, doubled: bool = False) -> None:
        super().__init__()
        self.top_k, self.doubled = 2, doubled
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 6, bias=False), nn.GELU(), nn.Linear(6, 8, bias=False))
            for _ in range(4)
        )
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(5)))

    def forward(self, x: Tensor) -> Tensor:
        scores = torch.sigmoid(self.router(x))
        w, idx = scores.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = (idx == e).any(-1, keepdim=True).to(x.dtype) * (w * (idx == e)).sum(-1, keepdim=True)
            out = out + hit * expert(x)
        return 2 * out if self.doubled else out


def test_a_sigmoid_router_and_gelu_experts_convert() -> None:
    model = nn.Sequential(_Sigmoid())
    converted = copy.deepcopy(model)
    convert_own_moe(converted)
    layer = converted[0]
    assert isinstance(layer, NamedMoE) and layer.experts.activation == "gelu" and not layer.router.renormalize
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(converted(x), model(x), **TOL)


def test_what_cannot_be_reproduced_is_refused_naming_why() -> None:
    with pytest.raises(ValueError, match=r"no reading of its experts.*tried.*sigmoid renormalize=False"):
        convert_own_moe(nn.Sequential(_Sigmoid(doubled=True)))
    no_k = Mixish(MixConfig())
    for layer in no_k.layers:
        del layer.moe.top_k
    with pytest.raises(ValueError, match="without a top-k attribute"):
        convert_own_moe(no_k)
    scaled = Mixish(MixConfig())
    original = type(scaled.layers[0].moe).forward

    def forward(self: Any, x: Tensor) -> Tensor:
        out = original(self, x)
        self.balance_loss = self.balance_loss * 0.5  # another normalisation than tessera.moe's
        return out

    for layer in scaled.layers:
        layer.moe.forward = forward.__get__(layer.moe)
    with pytest.raises(ValueError, match=r"balance_loss .* neither the load-balancing loss"):
        convert_own_moe(scaled)
    assert find_own_moe(Mixish(MixConfig())) and not find_own_moe(nn.Linear(2, 2))


def test_at_ep1_a_block_that_does_not_convert_trains_as_written() -> None:
    from tessera.launcher.train.boost import _own_experts

    model = nn.Sequential(_Sigmoid(doubled=True))
    groups = {n: 0 for n, _ in model.named_parameters()}
    assert _own_experts(model, groups, 1)[0] == groups and isinstance(model[0], _Sigmoid)
    with pytest.raises(ValueError, match="no reading of its experts"):
        _own_experts(model, groups, 2)


# ------------------------------------------------------------------------------------ tier 2
def _build(kind: str = "list") -> Mixish:
    return Mixish(MixConfig(shared=8), seed=0) if kind == "list" else _stacked()


def _serial(chunks: int, aux: float, kind: str) -> tuple[list[float], dict[str, Tensor]]:
    """The user's model as written, each step's batch in ``chunks`` chunks (dp x microbatches),
    each chunk's loss ``cross_entropy + aux * aux_loss()``, averaged."""
    model = _build(kind)

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux * model.aux_loss()

    return serial_run(model, TOKENS.first(STEPS), sgd(LR), chunks=chunks, loss=loss)


def _parallel(
    rank: int, config: BoostConfig, aux: float, plan: Any, export: str, kind: str
) -> tuple[list[float], dict[str, Tensor]]:
    model = _build(kind)

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux * model.aux_loss()

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = boost(model, opt, config, spec=ModelSpec(loss=loss), plan=plan)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    if export:
        engine.consolidate(export)
    engine.close()
    return losses, {}


# the user's roles with the head whole: their loss function reads whole logits
TP_ROLES = {k: v for k, v in MIXISH_ROLES.items() if k != "output"}
CASES = [
    ("dp2-ep2", "list", ParallelConfig(dp=2, ep=2, microbatches=1), 1, AUX, None, True),
    ("dp2-ep2-mb2-zero3", "list", ParallelConfig(dp=2, ep=2, microbatches=2), 3, AUX, None, False),
    ("tp2", "list", ParallelConfig(tp=2, microbatches=1), 0, AUX, TP_ROLES, True),
    ("pp2", "list", ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1, 0.0, None, False),
    ("stacked-dp2-ep2", "stacked", ParallelConfig(dp=2, ep=2, microbatches=1), 1, AUX, None, True),
]


@pytest.mark.parametrize(
    ("kind", "parallel", "zero", "aux", "plan", "verify"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_users_moe_trains_through_boost_as_written(
    worker_pools: PoolFactory,
    tmp_path: Path,
    kind: str,
    parallel: ParallelConfig,
    zero: int,
    aux: float,
    plan: Any,
    verify: bool,
) -> None:
    """Under pp the loss function runs on the last stage, which cannot read the first stage's
    aux losses: that run trains on the cross-entropy alone, as its serial run does."""
    config = BoostConfig(
        parallel=parallel,
        zero=ZeroConfig(stage=zero),
        train=TrainConfig(precision="fp32", verify=verify),
        optim=dataclasses.replace(BoostConfig().optim, clip_grad_norm=0.0),  # the serial run does not clip
    )
    path = tmp_path / "model.safetensors"
    results = worker_pools(config.world_size).run(_parallel, config, aux, plan, str(path), kind, timeout=240)
    want_losses, want = _serial(parallel.dp * parallel.microbatches, aux, kind)
    for rank, (losses, _) in enumerate(results):
        assert losses == pytest.approx(want_losses, rel=1e-5), f"rank {rank}: {losses} vs {want_losses}"
    state = safetensors.torch.load_file(path)
    assert state.keys() == want.keys(), sorted(set(state) ^ set(want))[:6]  # the user's names
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    fresh = _build(kind)
    fresh.load_state_dict(state, strict=True)
