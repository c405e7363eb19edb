"""Tier 1 (threaded ranks): low-rank adapters follow their base layer's split.

A user's own LoRA layer in PEFT's layout (a ``base_layer``, ``lora_A`` / ``lora_B`` ModuleDicts
of ``nn.Linear`` and a ``scaling`` per adapter; PEFT itself is not used here) wraps every
projection of ``Llamaish`` (names of its own: ``wq``, ``w1``, ...); the plan names the
projections as if they were plain linears. Each rank's gradients, after the partial ones are
summed, must be its shard of the serial gradients, and the first-backward proof
(``tp_gradient_problems``) must find every whole adapter gradient tagged as it really is
(complete or partial), with and without sequence parallelism, inside a region (the attention
and MLP) or entering and leaving the tp region alone (an MLP given no region), with one or two
adapters, and KV heads split or (fewer than tp) replicated.

Tolerance rtol 1e-4, atol 1e-6: fp32 round-off of products and sums over ranks run in
another order; a gradient summed wrongly is off by its own size (an adapter's ``lora_B``
gradient counted as partial without SP doubles it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.models import LLAMAISH_ROLES, ForeignConfig, Llamaish, LowRank, with_low_rank
from tessera.tensor_parallel import (
    parallelize,
    resolve_plan,
    shard_specs,
    sync_sequence_parallel_grads,
    tp_gradient_problems,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel.modes import plan_for_mode

TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
PLAN = LLAMAISH_ROLES  # the roles a user writes for it; the projections are adapted layers
NO_MLP_REGION = {k: v for k, v in PLAN.items() if k != "layers.*.ffn"}  # w1, w3 enter alone; w2 leaves


def adapted(cfg: ForeignConfig, adapters: tuple[str, ...]) -> Llamaish:
    return with_low_rank(Llamaish(cfg, seed=0), TARGETS, adapters=adapters)  # type: ignore[return-value]


def _batch(vocab: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


@settings(max_examples=8, deadline=None)
@given(
    sp=st.booleans(),
    regions=st.booleans(),
    adapters=st.sampled_from([("default",), ("default", "other")]),
    kv=st.sampled_from([1, 2]),
)
def test_adapters_train_on_their_shard_of_the_serial_gradients(
    sp: bool, regions: bool, adapters: tuple[str, ...], kv: int
) -> None:
    cfg = ForeignConfig(heads=4, kv_heads=kv)
    plan = PLAN if regions else NO_MLP_REGION
    idx, targets = _batch(cfg.vocab)
    serial = adapted(cfg, adapters)
    F.cross_entropy(serial(idx).flatten(0, 1), targets.flatten()).backward()
    want = {n: p.grad for n, p in serial.named_parameters() if p.grad is not None}
    assert any(".lora_A." in n for n in want) and any(".lora_B." in n for n in want)

    def rank(r: int) -> tuple[dict[str, Tensor], dict[str, object], list[str]]:
        mesh = Mesh(Topology(tp=2))
        group = mesh.group("tp")
        model = parallelize(adapted(cfg, adapters), plan=plan, mesh=mesh, sequence_parallel=sp)
        vocab_parallel_cross_entropy(model(idx).flatten(0, 1), targets.flatten(), group).backward()
        split = dict(shard_specs(model))
        problems = tp_gradient_problems({n: p for n, p in model.named_parameters() if n not in split}, group)
        sync_sequence_parallel_grads(model, group)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads, split, problems

    for r, (grads, split, problems) in enumerate(run_threaded(2, rank)):
        assert problems == []
        assert set(grads) == set(want)
        assert any(".lora_B." in n for n in split), "the colwise layers' lora_B are split"
        for name, g in grads.items():
            spec = split.get(name)
            expected = spec.shard(want[name], r, 2) if spec is not None else want[name]  # type: ignore[attr-defined]
            torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_each_part_takes_the_split_its_base_layer_implies() -> None:
    model = adapted(ForeignConfig(heads=4, kv_heads=1), ("default",))
    got = {a.name: a.style.name for a in resolve_plan(model, PLAN, tp=2) if ".layers.0." in f".{a.name}"}
    assert got["layers.0.attn.wq.base_layer"] == "colwise"
    assert got["layers.0.attn.wq.lora_B.default"] == "colwise"
    assert got["layers.0.attn.wq.lora_A.default"] == "adapter_whole"
    assert got["layers.0.attn.wo.lora_A.default"] == "rowwise"
    assert got["layers.0.attn.wo.lora_B.default"] == "after_exit"
    styles = {a.name: a.style for a in resolve_plan(model, PLAN, tp=2)}
    # one KV head under tp=2: the K projection's lora_B is replicated by heads, like its base layer
    assert getattr(styles["layers.0.attn.wk.lora_B.default"], "heads", None) == 1
    assert styles["layers.0.attn.wk.lora_B.default"] == styles["layers.0.attn.wk.base_layer"]


class Variant(LowRank):
    """An adapter whose forward is not the plain low-rank sum (as PEFT marks DoRA)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__(base, 2, ("default",), seed=0)
        self.use_dora = {"default": True}


class AdaptedEmbedding(nn.Module):
    """Adapters on an embedding, laid out as PEFT's (``lora_embedding_A``)."""

    def __init__(self, base: nn.Embedding) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_embedding_A = nn.ParameterDict(
            {"default": nn.Parameter(torch.zeros(2, base.num_embeddings))}
        )

    def forward(self, ids: Tensor) -> Tensor:
        return self.base_layer(ids)  # type: ignore[no-any-return]


def test_adapters_that_cannot_split_are_refused_by_name() -> None:
    model = Llamaish(ForeignConfig())
    model.layers[0].attn.wq = Variant(model.layers[0].attn.wq)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq \(colwise\): adapters default are a variant"):
        resolve_plan(model, PLAN, tp=2)
    model = Llamaish(ForeignConfig())
    model.tok_embeddings = AdaptedEmbedding(model.tok_embeddings)
    with pytest.raises(ValueError, match=r"tok_embeddings \(vocab\): .*expected torch.nn.Embedding"):
        resolve_plan(model, PLAN, tp=2)
    model = Llamaish(ForeignConfig())
    model.output = AdaptedEmbedding(nn.Embedding(4, 4))  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"output \(head\): .*carries adapters on a Embedding"):
        resolve_plan(model, PLAN, tp=2)


def test_adapters_under_2d_are_split_like_the_modes_linears() -> None:
    """2D, 2.5D, 3D: lora_A and lora_B are two more of the mode's linears (trained against serial
    in ``test_nd_roles.py``; under 3D lora_A's output moves back to its input's layout); adapter
    dropout is refused there."""
    model = adapted(ForeignConfig(heads=4, kv_heads=4), ("default",))
    plan = plan_for_mode(PLAN, TPMode.TWO_D, model)
    styles = {a.name: a.style for a in resolve_plan(model, plan, tp=4)}
    assert styles["layers.0.attn.wq.lora_B.default"] == styles["layers.0.attn.wq.base_layer"]
    assert styles["layers.0.attn.wq.lora_A.default"].name == styles["layers.0.attn.wq.base_layer"].name
    three_d = {a.name: a.style for a in resolve_plan(model, plan_for_mode(PLAN, TPMode.THREE_D, model), tp=8)}
    base, down = three_d["layers.0.attn.wq.base_layer"], three_d["layers.0.attn.wq.lora_A.default"]
    assert three_d["layers.0.attn.wq.lora_B.default"] == base
    # under 3D lora_A returns its output to its input's layout; the base and lora_B do not
    assert getattr(down.twin, "returns", None) is True and getattr(base.twin, "returns", None) is False
    model.layers[0].attn.wq.lora_dropout["default"] = nn.Dropout(0.1)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq\.lora_dropout\.default: adapter dropout"):
        resolve_plan(model, plan, tp=4)
