"""Tiers 0 and 1: hash routing (DeepSeek-V4's first layers: each token's experts read from a
fixed table ``router.tid2eid [vocab, k]`` at its token id, weighed by the router's scores at
them: `tessera.moe.hash_routing`) and the ``sqrtsoftplus`` score, against a token-by-token
reference written here, serially and at ep=2 (threaded).

Tolerances: the router's weights fp32 rtol 1e-6 (the same fp32 operations, in another order);
outputs and input gradients rtol 1e-5, atol 1e-6 and parameter gradients rtol 1e-5, atol 1e-5
(a few products of order 1 summed in another order, per rank then over ranks), as
``test_moe_ep.py``. Choices are compared exactly (they are read, not computed).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tessera.comm.testing import run_threaded
from tessera.moe import MoE, split_hidden
from tessera.moe.router import RouterSpec, route

close_out = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)  # outputs, input gradients
close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # parameter gradients
D, H, E, K, VOCAB, SCALE = 8, 6, 4, 2, 16, 1.5
SPEC = RouterSpec(score="sqrtsoftplus", scale=SCALE)


def _table(seed: int) -> Tensor:
    """Each id's ``K`` distinct experts, drawn from ``seed`` (not all the same expert)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)])


def _layer(seed: int, ep_group: dist.ProcessGroup | None = None) -> MoE:
    layer = MoE(D, H, E, K, routing=SPEC, hash_vocab=VOCAB, seed=seed, ep_group=ep_group)
    with torch.no_grad():
        layer.router.tid2eid.copy_(_table(seed))  # type: ignore[union-attr]
    return layer


def _reference(layer: MoE, x: Tensor, ids: Tensor) -> Tensor:
    """Token by token: the experts ``tid2eid[id]``, each weighed by ``sqrt(softplus(logit))``
    renormalised over the two and scaled, ``down(silu(x w1) * (x w3))`` per expert."""
    table, experts = layer.router.tid2eid, layer.experts
    assert table is not None and experts.w3 is not None
    outs = []
    for t, i in zip(x.reshape(-1, D), ids.reshape(-1), strict=True):
        scores = F.softplus(layer.router.weight @ t).sqrt()
        chosen = table[i]
        weights = scores[chosen] / (scores[chosen].sum() + 1e-20) * SCALE
        y = sum(
            w * ((F.silu(t @ experts.w1[e]) * (t @ experts.w3[e])) @ experts.w2[e])
            for w, e in zip(weights, chosen.tolist(), strict=True)
        )
        outs.append(y)
    return torch.stack(outs).reshape(x.shape)  # type: ignore[arg-type]


def _inputs(seed: int, batch: int = 3, seq: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, D, generator=gen)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return x, ids, torch.randn(batch, seq, D, generator=gen)


def test_sqrtsoftplus_scores_weigh_the_chosen_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, E, generator=gen) * 2
    routing = route(logits, K, renormalize=True, spec=SPEC)
    scores = F.softplus(logits).sqrt()
    assert torch.equal(routing.choices, torch.topk(scores, K, dim=-1).indices)
    want = scores.gather(1, routing.choices)
    torch.testing.assert_close(
        routing.weights, want / (want.sum(-1, keepdim=True) + 1e-20) * SCALE, rtol=1e-6, atol=0
    )
    torch.testing.assert_close(routing.probs, scores / scores.sum(-1, keepdim=True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_hash_layer_computes_the_token_by_token_reference(seed: int) -> None:
    """Outputs, the input's gradient and every parameter's (the router's through the weights)."""
    layer = _layer(seed)
    x, ids, g = _inputs(seed)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = layer(xa, input_ids=ids)
    assert torch.equal(
        layer.router(x.reshape(-1, D), ids).choices,
        layer.router.tid2eid[ids.reshape(-1)],  # type: ignore[index]
    )
    (got * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    want = _reference(layer, xb, ids)
    (want * g).sum().backward()
    close_out(got, want)
    close_out(xa.grad, xb.grad)
    assert set(grads) == {n for n, _ in layer.named_parameters()}
    for n, p in layer.named_parameters():
        close_grad(grads[n], p.grad, msg=lambda m, n=n: f"{n}: {m}")


def test_the_table_is_a_persistent_buffer_never_trained() -> None:
    layer = _layer(0)
    assert "router.tid2eid" in layer.state_dict() and layer.state_dict()["router.tid2eid"].dtype == torch.long
    assert "router.tid2eid" not in dict(layer.named_parameters())
    fresh = MoE(D, H, E, K, routing=SPEC, hash_vocab=VOCAB, seed=0)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.router.tid2eid, _table(0))  # type: ignore[arg-type]


def _ep_rank(rank: int, xs: list[Tensor], ids: list[Tensor], gs: list[Tensor]) -> dict[str, Any]:
    layer = _layer(7, ep_group=dist.group.WORLD)
    x = xs[rank].clone().requires_grad_()
    y = layer(x, input_ids=ids[rank])
    (y * gs[rank]).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "first": layer.first_expert}


def test_expert_parallel_equals_the_serial_layer() -> None:
    """At ep=2 each rank's tokens (and ids) give the serial layer's outputs on them; each rank's
    experts' gradients are the serial layer's on all tokens, the router's summed over ranks."""
    runs = [_inputs(10 + r, batch=2, seq=4 + r) for r in range(2)]
    xs, ids, gs = ([run[i] for run in runs] for i in range(3))
    got = run_threaded(2, _ep_rank, xs, ids, gs, timeout=60)
    serial = _layer(7)
    x = torch.cat([t.reshape(-1, D) for t in xs]).requires_grad_()
    y = serial(x, input_ids=torch.cat([i.reshape(-1) for i in ids]))
    (y * torch.cat([g.reshape(-1, D) for g in gs])).sum().backward()
    ys, dxs = y.detach().split([t[..., 0].numel() for t in xs]), x.grad.split([t[..., 0].numel() for t in xs])
    for r, run in enumerate(got):
        close_out(run["y"], ys[r].reshape(xs[r].shape))
        close_out(run["dx"], dxs[r].reshape(xs[r].shape))
        local = slice(run["first"], run["first"] + E // 2)
        for n in ("experts.w1", "experts.w2", "experts.w3"):
            close_grad(run["grads"][n], serial.get_parameter(n).grad[local], msg=lambda m, n=n: f"{n}: {m}")
    close_grad(sum(run["grads"]["router.weight"] for run in got), serial.router.weight.grad)


def test_bad_ids_and_tables_are_refused_naming_the_values() -> None:
    layer = _layer(0)
    x, ids, _ = _inputs(0)
    with pytest.raises(ValueError, match="call it with input_ids"):
        layer(x)
    with pytest.raises(ValueError, match="15 tokens, got 14 ids"):
        layer(x, input_ids=ids.reshape(-1)[:14])
    with pytest.raises(ValueError, match=r"input_ids in \[0, 16\] fall outside the hash table's 16 rows"):
        layer(x, input_ids=torch.where(ids == ids.max(), 16, ids).index_fill(1, torch.tensor([0]), 0))
    with torch.no_grad():
        layer.router.tid2eid[ids[0, 0]] = E  # type: ignore[index]
    with pytest.raises(ValueError, match=rf"outside \[0, {E}\)"):
        layer(x, input_ids=ids)
    with pytest.raises(ValueError, match="chooses by its table: no choice bias"):
        MoE(D, H, E, K, routing=RouterSpec(score="sqrtsoftplus", choice_bias=True), hash_vocab=VOCAB, seed=0)


def test_without_a_table_the_ids_are_ignored() -> None:
    """A top-k layer beside hash layers takes the ids its decoder layer passes to every block."""
    layer = MoE(D, H, E, K, routing=SPEC, seed=0)
    x, ids, _ = _inputs(0)
    assert torch.equal(layer(x, input_ids=ids), layer(x))


def _tp_rank(rank: int, x: Tensor, ids: Tensor, g: Tensor, sp: bool) -> dict[str, Any]:
    layer = split_hidden(_layer(3), dist.group.WORLD, sequence_parallel=sp)
    mine = x.clone().requires_grad_()
    try:
        out = layer(mine, input_ids=ids)
    except ValueError as exc:
        return {"refused": str(exc)}
    (out * g).sum().backward()
    return {"out": out.detach(), "dx": mine.grad, "router": layer.router.weight.grad}


def test_a_hash_layer_split_over_tp_equals_the_serial_layer() -> None:
    """tp=2 (``split_hidden``, no sequence parallelism): every rank routes the same whole tokens
    by the same ids; the router's gradient summed over tp is the serial one."""
    x, ids, g = _inputs(4)
    serial = _layer(3)
    xs = x.clone().requires_grad_()
    want = serial(xs, input_ids=ids)
    (want * g).sum().backward()
    runs = run_threaded(2, _tp_rank, x, ids, g, False, timeout=60)
    for run in runs:
        close_out(run["out"], want.detach())
        close_out(run["dx"], xs.grad)
    close_grad(sum(run["router"] for run in runs), serial.router.weight.grad)


def test_a_hash_layer_under_sequence_parallelism_is_refused() -> None:
    """Its input gathered over the sequence, its ids would not be: refused, naming why."""
    x, ids, g = _inputs(4)
    for run in run_threaded(2, _tp_rank, x, ids, g, True, timeout=60):
        assert "its token ids are not gathered" in run["refused"]
