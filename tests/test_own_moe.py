"""A user's own mixture of experts, under its own names, through ``boost()`` with nothing
converted by hand.

The model is ``tessera.models.foreign_moe.Mixish``: a Llama-style model whose MLPs are a
plain-PyTorch sparse mixture (router ``gate``, an ``nn.ModuleList`` of SwiGLU experts named
``gate_proj`` / ``up_proj`` / ``down_proj``, an optional ``shared_expert``; softmax top-k
looping over the experts) that records its load-balancing loss as ``balance_loss``, summed
by the model's ``aux_loss()``. Its loss function is what a user writes:
``cross_entropy + AUX * model.aux_loss()``, a closure over the model.

``Seekish`` is the same model with DeepSeek-V3's routing as a user writes it (router
``router``, a buffer ``gate_bias`` that chooses but does not weigh, 2 of 4 groups by their two
best biased scores, weights renormalised and times ``scale`` 2.5, a shared expert; no aux
loss).

Tier 0: ``convert_own_moe`` finds the blocks by their roles, measures which projection is
the gate, whether the router scores by softmax or sigmoid, which choice bias and group limit
it applies, its scale and whether the top-k weights are renormalised, and the converted model
gives the same logits, and the converted block the same outputs and gradients (also for
experts stored stacked with a router nested in a module, for a sigmoid router over GELU
experts, and for Seekish's bias as a buffer, as a frozen parameter or at zero; its bias keeps
its name, its values and its effect when the user moves it in place; under
``deferred_parameters()`` it stays real; a block's other buffers, a load counter its forward
moves, are kept under their names at their values, the moved one logged); what it cannot
reproduce is refused, naming why.
Tier 2: ``boost()`` converts it itself and trains it at dp2 x ep2 (ZeRO 1, and ZeRO 3
with two microbatches), tp2 (the mixture replicated) and pp2, equal to the serial run of the
model as the user wrote it, which adds the aux loss to each (rank, microbatch) chunk's loss
(the load-balancing loss is a per-call statistic), the stacked mixture at dp2 x ep2 and
Seekish at dp2 x ep2 ZeRO 3, the counting blocks at dp2 x ep2; ``verify=True`` passes; each
export carries the user's names (``gate_bias`` included) and loads strictly into a fresh copy of
the user's model.

Bounds: logits, and the block's outputs and gradients, of the conversion fp32 rtol 1e-5 /
atol 1e-6 (the same products, a per-expert loop against one batched matmul: summation order
only; gradients are compared at the block, whose inputs are of order 1: the model's embedding
gradient sums many tokens' and reaches order 50, where round-off alone passes 1e-6, so it and
the embedding it trains get atol 1e-5 (`EMBEDDING_TOL`: measured 4.1e-6 on its gradient and
1.2e-6 on its weights after 3 steps, on an AMD EPYC). Trained runs: losses rel 1e-5, weights
after 3 SGD steps rtol 1e-5 + atol 1e-6 (SGD is linear in the gradient, so round-off is not
amplified; routers of order 1 keep every choice far from a tie). A lost expert, a wrong gate/up
reading, a bias ignored in the choice or an aux loss that no longer changes is off at order 1e-2
or more.
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
from tessera.launcher.train.deferred import deferred_parameters
from tessera.models.foreign_moe import MIXISH_ROLES, MixConfig, Mixish, SeekConfig, Seekish, SparseMoE
from tessera.moe import RouterSpec

VOCAB, SEQ, BATCH, STEPS, LR, AUX = 64, 8, 8, 3, 0.1, 0.05
TOL = {"rtol": 1e-5, "atol": 1e-6}
EMBEDDING_TOL = {"rtol": 1e-5, "atol": 1e-5}  # sums over many tokens (module docstring)


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
    torch.testing.assert_close(
        converted.tok_embeddings.weight.grad, model.tok_embeddings.weight.grad, **EMBEDDING_TOL
    )


class _Sigmoid(nn.Module):
    """A mixture whose router scores each expert with a sigmoid (weights unnormalised) and whose
    experts are ``nn.Sequential(Linear, GELU, Linear)``; ``tempered``: its logits halved before
    the sigmoid, which no reading reproduces (the router's weight is copied as it is)."""

    def __init__(self, tempered: bool = False) -> None:
        super().__init__()
        self.top_k, self.tempered = 2, tempered
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 6, bias=False), nn.GELU(), nn.Linear(6, 8, bias=False))
            for _ in range(4)
        )
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(5)))

    def forward(self, x: Tensor) -> Tensor:
        scores = torch.sigmoid(self.router(x) / (2 if self.tempered else 1))
        w, idx = scores.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = (idx == e).any(-1, keepdim=True).to(x.dtype) * (w * (idx == e)).sum(-1, keepdim=True)
            out = out + hit * expert(x)
        return out


def test_a_sigmoid_router_and_gelu_experts_convert() -> None:
    model = nn.Sequential(_Sigmoid())
    converted = copy.deepcopy(model)
    convert_own_moe(converted)
    layer = converted[0]
    assert isinstance(layer, NamedMoE) and layer.experts.activation == "gelu" and not layer.router.renormalize
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(converted(x), model(x), **TOL)


def test_what_cannot_be_reproduced_is_refused_naming_why() -> None:
    refusal = r"0 \(_Sigmoid\): no reading of its experts and router .* tried experts \[w1=.*sigmoid top-2"
    with pytest.raises(ValueError, match=refusal):
        convert_own_moe(nn.Sequential(_Sigmoid(tempered=True)))
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
    trained = Seekish(SeekConfig())
    for block in trained.blocks():
        block.gate_bias = nn.Parameter(block._buffers.pop("gate_bias"))
    with pytest.raises(
        ValueError, match=r"\['gate_bias'\] \(8,\) train, .* register it as a buffer or freeze it"
    ):
        convert_own_moe(trained)
    balancing = Seekish(SeekConfig())
    biased = type(balancing.blocks()[0]).forward

    def moving(self: Any, x: Tensor) -> Tensor:
        out = biased(self, x)
        self.gate_bias.add_(1e-3)  # balanced inside the forward, which the converted router would not do
        return out

    for block in balancing.blocks():
        block.forward = moving.__get__(block)
    with pytest.raises(
        ValueError, match=r"layers.0.moe \(BiasedMoE\): its forward changes its choice bias gate_bias"
    ):
        convert_own_moe(balancing)
    assert torch.equal(
        balancing.blocks()[0].gate_bias, Seekish(SeekConfig()).blocks()[0].gate_bias
    )  # put back
    assert find_own_moe(Mixish(MixConfig())) and not find_own_moe(nn.Linear(2, 2))


def test_at_ep1_a_block_that_does_not_convert_trains_as_written() -> None:
    from tessera.launcher.train.boost import _own_experts

    model = nn.Sequential(_Sigmoid(tempered=True))
    groups = {n: 0 for n, _ in model.named_parameters()}
    assert _own_experts(model, groups, 1)[0] == groups and isinstance(model[0], _Sigmoid)
    with pytest.raises(ValueError, match="no reading of its experts"):
        _own_experts(model, groups, 2)


def _seekish(bias: str = "buffer") -> Seekish:
    """``Seekish`` with its ``gate_bias`` as written (a buffer), as a frozen parameter, or left at
    zero as a freshly built model holds it (the probe gives it values of its own)."""
    model = Seekish(SeekConfig(), seed=0)
    for block in model.blocks():
        if bias == "zero":
            block.gate_bias.zero_()
        elif bias == "frozen-parameter":
            value = block._buffers.pop("gate_bias")
            block.gate_bias = nn.Parameter(value, requires_grad=False)
    return model


@pytest.mark.parametrize("bias", ["buffer", "frozen-parameter", "zero"])
def test_a_deepseek_style_router_converts(bias: str) -> None:
    """Sigmoid scores, a choice bias, 2 of 4 groups by their two best, scale 2.5 and a shared
    expert, all measured; the bias keeps its name and its values, and the router reads it
    where the user's loop moves it."""
    model = _seekish(bias)
    converted = copy.deepcopy(model)
    assert convert_own_moe(converted).blocks == ["layers.0.moe", "layers.1.moe"]
    layer, theirs = converted.get_submodule("layers.1.moe"), model.get_submodule("layers.1.moe")
    assert isinstance(layer, NamedMoE) and layer.router.renormalize and layer.shared is not None
    assert layer.router.spec == RouterSpec(
        "sigmoid", True, groups=4, top_groups=2, group_score="top2", scale=2.5
    )
    assert layer.router.score_bias is layer.gate_bias and "gate_bias" not in dict(layer.named_parameters())
    torch.testing.assert_close(layer.gate_bias, theirs.gate_bias, rtol=0, atol=0)
    experts = {
        f"layers.{i}.moe.{g}.{w}" for i in (0, 1) for g in ("experts", "shared") for w in ("w1", "w2", "w3")
    }
    users = {k for k in model.state_dict() if ".experts." not in k and ".shared_expert." not in k}
    assert converted.state_dict().keys() == users | experts  # gate_bias by the user's name, no score_bias
    ids = TOKENS.at(0)[0]
    want = model(ids)
    torch.testing.assert_close(converted(ids), want, **TOL)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    g = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2))
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_theirs, y_ours = theirs(x_theirs), layer(x_ours)
    torch.testing.assert_close(y_ours, y_theirs, **TOL)
    (y_theirs * g).sum().backward()
    (y_ours * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    torch.testing.assert_close(layer.router.weight.grad, theirs.router.weight.grad, **TOL)
    torch.testing.assert_close(layer.experts.w1.grad[5], theirs.experts[5].gate_proj.weight.grad.t(), **TOL)
    torch.testing.assert_close(layer.experts.w3.grad[2], theirs.experts[2].up_proj.weight.grad.t(), **TOL)
    torch.testing.assert_close(layer.shared.w2.grad[0], theirs.shared_expert.down_proj.weight.grad.t(), **TOL)
    with torch.no_grad():  # a balancing step of the user's loop, in place, under the user's name
        for m in (model, converted):
            for block in m.blocks():
                block.gate_bias.add_(torch.linspace(-0.3, 0.3, 8))
    moved = model(ids)
    assert (moved - want).abs().max() > 1e-3  # the bias chooses
    torch.testing.assert_close(converted(ids), moved, **TOL)


def test_a_group_limit_that_few_tokens_exercise_is_told_apart() -> None:
    """16 experts in 8 groups, of which a token keeps 6: on the probe's tokens no group limit,
    and other limits, give the block's output as well; run again on tokens where they route
    differently, the block shows its own."""
    model = Seekish(SeekConfig(experts=16, groups=8, keep_groups=6), seed=0)
    converted = copy.deepcopy(model)
    convert_own_moe(converted)
    spec = converted.get_submodule("layers.0.moe").router.spec
    assert (spec.groups, spec.top_groups, spec.group_score) == (8, 6, "top2")
    ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(converted(ids), model(ids), **TOL)


def test_a_deferred_deepseek_style_model_keeps_its_bias_real() -> None:
    """Built by ``deferred_parameters()``: the layers stay on meta, the bias (a buffer, real)
    keeps the values the model drew; a bias held as a parameter is refused (no values)."""
    eager = Seekish(SeekConfig(), seed=0)
    with deferred_parameters():
        model = Seekish(SeekConfig(), seed=0)
    convert_own_moe(model)
    layer = model.get_submodule("layers.0.moe")
    assert isinstance(layer, NamedMoE) and all(p.is_meta for p in layer.parameters())
    assert layer.router.score_bias is layer.gate_bias and not layer.gate_bias.is_meta
    torch.testing.assert_close(layer.gate_bias, eager.blocks()[0].gate_bias, rtol=0, atol=0)
    with deferred_parameters():
        frozen = Seekish(SeekConfig(), seed=0)
        for block in frozen.blocks():
            block.gate_bias = nn.Parameter(block._buffers.pop("gate_bias"), requires_grad=False)
    with pytest.raises(ValueError, match=r"layers.0.moe: its choice bias gate_bias is a parameter"):
        convert_own_moe(frozen)


class Counting(SparseMoE):
    """``Mixish``'s block with a load counter its forward moves (``tokens_per_expert``,
    persistent) and a non-persistent scratch buffer: neither is the converted layer's work."""

    def __init__(self, c: MixConfig) -> None:
        super().__init__(c)
        self.register_buffer("tokens_per_expert", torch.arange(float(c.experts)))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        self.tokens_per_expert += 1.0
        return out


def _counting() -> Mixish:
    model = Mixish(MixConfig(shared=8), seed=0)
    for layer in model.layers:
        block = Counting(MixConfig(shared=8))
        block.load_state_dict(layer.moe.state_dict(), strict=False)  # the same weights
        layer.moe = block
    return model


def test_other_buffers_of_a_block_are_kept_under_their_names(caplog: pytest.LogCaptureFixture) -> None:
    """A buffer the conversion does not use keeps its name, its value from before the probe
    (the user's block is left as it was too) and its persistence; one the forward moves is
    logged, since the converted layer no longer moves it."""
    model = _counting()
    converted = copy.deepcopy(model)
    with caplog.at_level("WARNING", logger="tessera.launcher.families.own_moe"):
        convert_own_moe(converted)
    assert "layers.0.moe.tokens_per_expert changes in Counting's forward" in caplog.text
    names = set(converted.state_dict())
    assert {n for n in model.state_dict() if "tokens_per_expert" in n} <= names
    assert not any("scratch" in n for n in names)  # non-persistent, as it was
    for layer in converted.layers:
        assert torch.equal(layer.moe.tokens_per_expert, torch.arange(4.0))
        assert torch.equal(layer.moe.scratch, torch.ones(3))
    assert all(torch.equal(b.tokens_per_expert, torch.arange(4.0)) for b in model.blocks())
    ids = TOKENS.at(0)[0]
    torch.testing.assert_close(converted(ids), model(ids), **TOL)


# ------------------------------------------------------------------------------------ tier 2
def _build(kind: str = "list") -> nn.Module:
    if kind == "seek":
        return Seekish(SeekConfig(), seed=0)
    if kind == "counting":
        return _counting()
    return Mixish(MixConfig(shared=8), seed=0) if kind == "list" else _stacked()


def _objective(model: Any, aux: float) -> Any:
    """The user's loss: cross-entropy, plus ``aux`` times the model's ``aux_loss()`` if any."""

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return entropy + aux * model.aux_loss() if aux else entropy

    return loss


def _serial(chunks: int, aux: float, kind: str) -> tuple[list[float], dict[str, Tensor]]:
    """The user's model as written, each step's batch in ``chunks`` chunks (dp x microbatches),
    each chunk's loss ``cross_entropy + aux * aux_loss()``, averaged; its parameters after
    training and its persistent buffers (Seekish's ``gate_bias``, which training leaves)."""
    model = _build(kind)
    losses, weights = serial_run(
        model, TOKENS.first(STEPS), sgd(LR), chunks=chunks, loss=_objective(model, aux)
    )
    buffers = {n: b for n, b in model.state_dict().items() if n not in weights}
    return losses, {**weights, **buffers}


def _parallel(
    rank: int, config: BoostConfig, aux: float, plan: Any, export: str, kind: str
) -> tuple[list[float], dict[str, Tensor]]:
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = boost(model, opt, config, spec=ModelSpec(loss=_objective(model, aux)), plan=plan)
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
    ("seek-dp2-ep2-zero3", "seek", ParallelConfig(dp=2, ep=2, microbatches=1), 3, 0.0, None, True),
    # a load counter kept (export, strict load), at its value from before the conversion
    ("counting-dp2-ep2", "counting", ParallelConfig(dp=2, ep=2, microbatches=1), 1, AUX, None, False),
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
    aux losses: that run trains on the cross-entropy alone, as its serial run does (and so does
    Seekish, which has none). The export holds the user's names, persistent buffers included."""
    config = BoostConfig(
        parallel=parallel,
        zero=ZeroConfig(stage=zero),
        train=TrainConfig(precision="fp32", verify=verify),
        optim=dataclasses.replace(BoostConfig().optim, clip_grad_norm=0.0),  # the serial run does not clip
    )
    path = tmp_path / "model.safetensors"
    results = worker_pools(config.world_size).run(_parallel, config, aux, plan, str(path), kind, timeout=240)
    want_losses, want = _serial(parallel.dp * parallel.microbatches, aux, kind)
    if kind == "counting":  # the user's forward moved its counters; the converted layers do not
        want |= {n: torch.arange(4.0) for n in want if n.endswith("tokens_per_expert")}
    for rank, (losses, _) in enumerate(results):
        assert losses == pytest.approx(want_losses, rel=1e-5), f"rank {rank}: {losses} vs {want_losses}"
    state = safetensors.torch.load_file(path)
    assert state.keys() == want.keys(), sorted(set(state) ^ set(want))[:6]  # the user's names
    embedding = "tok_embeddings.weight"
    torch.testing.assert_close(state[embedding], want[embedding], **EMBEDDING_TOL)
    rest = [n for n in want if n != embedding]
    torch.testing.assert_close({n: state[n] for n in rest}, {n: want[n] for n in rest}, **TOL)
    fresh = _build(kind)
    fresh.load_state_dict(state, strict=True)
