"""Tier 1 (threaded ranks): every parameter of a parallelized model is accounted for.

A plan that names only the linear layers (as users write them) must still give the serial
gradients: with sequence parallelism the norms of the residual stream are found and summed
over tp, anything kept whole inside an attention/MLP region is summed too, and the
first-backward proof (``tp_gradient_problems``) refuses a gradient that a rule got wrong, in
either direction. Grouped-query attention whose module names no KV head count is read from
its projections' widths (tp above the KV heads replicates them).

Gradients are compared with the serial model's to rtol 1e-4, atol 1e-6: fp32 round-off only
(the row-parallel products and the sums over ranks run in another order); a norm gradient
left partial is off by about its own size (measured 9e-3 absolute on these models).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.models import ForeignConfig, Llamaish
from tessera.tensor_parallel import (
    BaseStyle,
    coverage,
    parallelize,
    register_style,
    shard_specs,
    sync_sequence_parallel_grads,
    tp_gradient_problems,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel.partition import ShardSpec

LINEARS_ONLY = {  # no norm named: the README's way of writing a plan
    "tok_embeddings": "vocab",
    "layers.*.attn": "attention",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.ffn": "region",
    "layers.*.ffn.w1": "colwise",
    "layers.*.ffn.w3": "colwise",
    "layers.*.ffn.w2": "rowwise",
    "output": "colwise",
}


def _batch(vocab: int, seq: int = 16) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _serial_grads(model: nn.Module, idx: Tensor, targets: Tensor) -> dict[str, Tensor]:
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _parallel_grads(
    build: object, plan: dict[str, str], tp: int, *, sp: bool, idx: Tensor, targets: Tensor
) -> list[tuple[dict[str, Tensor], dict[str, ShardSpec]]]:
    """Each rank's gradients after the sum of partial ones, with the model's shard specs."""

    def rank(r: int) -> tuple[dict[str, Tensor], dict[str, ShardSpec]]:
        mesh = Mesh(Topology(tp=tp))
        group = mesh.group("tp")
        model = parallelize(build(), plan=plan, mesh=mesh, sequence_parallel=sp)  # type: ignore[operator]
        loss = vocab_parallel_cross_entropy(model(idx).flatten(0, 1), targets.flatten(), group)
        loss.backward()
        split = dict(shard_specs(model))
        whole = {n: p for n, p in model.named_parameters() if n not in split}
        assert tp_gradient_problems(whole, group) == []
        sync_sequence_parallel_grads(model, group)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, split

    return run_threaded(tp, rank)


Grads = list[tuple[dict[str, Tensor], dict[str, ShardSpec]]]  # per rank: gradients, shard specs


def _assert_shards(got: Grads, want: dict[str, Tensor]) -> None:
    tp = len(got)
    for r, (grads, specs) in enumerate(got):
        assert set(grads) == set(want)
        for name, g in grads.items():
            full = want[name]
            expected = specs[name].shard(full, r, tp) if name in specs else full
            torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("tp", "kv", "sp"), [(2, 2, True), (2, 2, False), (4, 4, True), (4, 2, False), (4, 1, True)]
)
def test_a_plan_naming_only_linears_gives_the_serial_gradients(tp: int, kv: int, sp: bool) -> None:
    cfg = ForeignConfig(heads=4, kv_heads=kv)
    idx, targets = _batch(cfg.vocab)
    want = _serial_grads(Llamaish(cfg), idx, targets)
    got = _parallel_grads(lambda: Llamaish(cfg), LINEARS_ONLY, tp, sp=sp, idx=idx, targets=targets)
    _assert_shards(got, want)


def test_coverage_names_the_norms_it_sums_and_logs_them_once(caplog: pytest.LogCaptureFixture) -> None:
    def rank(r: int) -> tuple[dict[str, str], tuple[str, ...]]:
        model = parallelize(Llamaish(), plan=LINEARS_ONLY, mesh=Mesh(Topology(tp=2)), sequence_parallel=True)
        c = coverage(model)
        return dict(c.partial), c.undeclared

    with caplog.at_level(logging.WARNING, logger="tessera.tensor_parallel.parallelize"):
        (partial, undeclared), _ = run_threaded(2, rank)
    assert set(partial) == {
        "layers.0.attn_norm.scale", "layers.0.ffn_norm.scale", "layers.1.attn_norm.scale",
        "layers.1.ffn_norm.scale", "norm.scale",
    }  # fmt: skip
    assert set(undeclared) == set(partial)
    lines = [r.getMessage() for r in caplog.records if "partial gradients" in r.getMessage()]
    assert len(lines) == 2  # once per rank (threads share the logger)
    assert "layers.*.attn_norm.scale (in the sequence-parallel stream)" in lines[0]


# ---------------------------------------------------------------- GQA from the widths alone
class WidthsOnly(nn.Module):
    """Names its query heads only; K/V heads come out of the tensors' shapes (-1 views)."""

    def __init__(self, d: int, heads: int, kv: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv * self.head_dim, bias=False)
        self.v = nn.Linear(d, kv * self.head_dim, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class TinyLM(nn.Module):
    def __init__(self, kv: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 32)
        self.mix = WidthsOnly(32, 4, kv)
        self.norm = nn.LayerNorm(32)
        self.lm = nn.Linear(32, 32, bias=False)
        gen = torch.Generator().manual_seed(0)  # not the global RNG: ranks are threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        h = h + self.mix(h)
        return self.lm(self.norm(h))  # type: ignore[no-any-return]


TINY_PLAN = {"emb": "vocab", "mix": "attention", "mix.q": "colwise", "mix.k": "colwise",
             "mix.v": "colwise", "mix.o": "rowwise", "lm": "colwise"}  # fmt: skip


@pytest.mark.parametrize(("tp", "kv"), [(4, 2), (4, 1), (2, 2)])
def test_kv_heads_come_from_the_projection_widths(tp: int, kv: int) -> None:
    idx, targets = _batch(32)
    want = _serial_grads(TinyLM(kv), idx, targets)
    got = _parallel_grads(lambda: TinyLM(kv), TINY_PLAN, tp, sp=False, idx=idx, targets=targets)
    _assert_shards(got, want)


# ---------------------------------------------------------------- the proof refuses wrong rules
def _problems(model_fn: object, plan: dict[str, str], *, sp: bool) -> list[str]:
    idx, targets = _batch(32)

    def rank(r: int) -> list[str]:
        mesh = Mesh(Topology(tp=2))
        group = mesh.group("tp")
        model = parallelize(model_fn(), plan=plan, mesh=mesh, sequence_parallel=sp)  # type: ignore[operator]
        vocab_parallel_cross_entropy(model(idx).flatten(0, 1), targets.flatten(), group).backward()
        split = shard_specs(model)
        return tp_gradient_problems({n: p for n, p in model.named_parameters() if n not in split}, group)

    return run_threaded(2, rank)[0]


def test_the_proof_refuses_a_complete_gradient_about_to_be_summed() -> None:
    """A gain applied after the attention's exit, registered on the region module: the rule
    (inside a region: partial) is wrong for it, and the first backward says so."""

    class Gated(TinyLM):
        def __init__(self) -> None:
            super().__init__(4)
            self.mix.gate = nn.Parameter(torch.tensor(0.7))
            inner = self.mix.forward
            self.mix.forward = lambda x: inner(x) * self.mix.gate  # type: ignore[method-assign]

    problems = _problems(Gated, TINY_PLAN, sp=False)
    assert len(problems) == 1 and problems[0].startswith("mix.gate: its gradient would be summed over tp")


@pytest.fixture(scope="module")
def wrong_style() -> str:
    class ClaimsComplete(BaseStyle):
        grad_complete = True  # the author's claim; under SP a norm's gradient is partial

    register_style(ClaimsComplete("claims_complete_for_test"), replace=True)
    return "claims_complete_for_test"


def test_the_proof_refuses_a_partial_gradient_left_unsummed(wrong_style: str) -> None:
    problems = _problems(lambda: TinyLM(4), {**TINY_PLAN, "norm": wrong_style}, sp=True)
    names = sorted(p.split(":")[0] for p in problems)
    assert names == ["norm.bias", "norm.weight"], problems
    assert "differs across tp ranks" in problems[0]
