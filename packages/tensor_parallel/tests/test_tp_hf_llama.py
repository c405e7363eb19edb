"""Optional (extra ``hf``): Hugging Face transformers' Llama, built from a config (random init,
nothing downloaded), converted by parallelize(LLAMA_PLAN) on threaded ranks, equals the
serial model, with multi-head (8 KV heads), grouped-query (4 and 2 KV heads) and multi-query
(1 KV head) attention at tp 2 and 4: KV heads split where tp divides them, replicated where
they are fewer than tp (each rank holds the KV head its query heads read; the copies'
gradients are summed). HF's decoder calls its attention by keyword (``hidden_states=``).

Each rank's loss and every gradient shard (each copy of a replicated K/V head included) are
compared with the serial ones, and every split gradient, unsharded from all ranks by its
recorded ``ShardSpec`` (``HeadShardSpec`` for K/V under GQA), with the serial gradient.
Tolerances: the loss (~4.2) to rtol 1e-5, atol 1e-6, every gradient to rtol 1e-4, atol 1e-6:
fp32 round-off only (the row-parallel products, the vocab-parallel softmax and the summed
K/V copies add in another order; measured over all cases, the loss is off by <= 4.8e-7 and
no gradient (up to ~0.5) by more than 1.6e-7), while a query head reading the wrong KV head,
a missing sum of the K/V copies or a wrong shard is off by the size of the gradient itself.
A head layout that cannot split is refused by ``resolve_plan`` (pure: no process group
exists) and by ``parallelize`` on every rank with no collective made and nothing changed.

Runs in ``hatch test`` (the hatch-test environment installs transformers); skipped, with the
reason in the summary, where transformers is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.comm import CommMeter, Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import (
    LLAMA_PLAN,
    HeadShardSpec,
    parallelize,
    resolve_plan,
    shard_of,
    shard_specs,
    vocab_parallel_cross_entropy,
)

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: the HF Llama plan is NOT tested "
    "(pip install 'tessera-tensor-parallel[hf]' to test it)",
)

VOCAB, SEQ, HEADS = 64, 8, 8


def _model(kv: int, attn: str = "eager", heads: int = HEADS) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=SEQ,
        attention_bias=kv == 2,  # a bias on q/k/v/o: the replicated K/V copies sum it too
    )  # fmt: skip
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config)


def _rank(rank: int, n: int, kv: int, attn: str, state: dict[str, Tensor], batch: tuple[Tensor, Tensor],
          grads: dict[str, Tensor]) -> Any:  # fmt: skip
    mesh = Mesh(Topology(tp=n))
    model = _model(kv, attn)
    model.load_state_dict(state)
    parallelize(model, plan=LLAMA_PLAN, mesh=mesh)
    idx, targets = batch
    logits = model(idx, use_cache=False).logits
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), mesh.group("tp"))
    loss.backward()
    named = dict(model.named_parameters())
    pairs = {k: (p.grad, shard_of(model, k, grads[k])) for k, p in named.items()}
    split = {k: named[k].grad for k in shard_specs(model)}
    attn0 = model.model.layers[0].self_attn
    return loss.detach(), pairs, split, shard_specs(model), attn0.num_key_value_groups


CASES = [(2, 8), (2, 4), (2, 2), (2, 1), (4, 8), (4, 4), (4, 2), (4, 1)]  # (tp, kv heads)


@pytest.mark.parametrize(("n", "kv"), CASES)
def test_hf_llama_parallel_equals_serial(n: int, kv: int) -> None:
    attn = "sdpa" if kv == 1 else "eager"  # both of HF's attention paths
    torch.manual_seed(0)
    serial = _model(kv, attn)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    loss = F.cross_entropy(serial(idx, use_cache=False).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {name: p.grad for name, p in serial.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(serial.parameters()))
    results = run_threaded(n, _rank, n, kv, attn, serial.state_dict(), (idx, targets), grads)
    for parallel_loss, pairs, _, _, groups in results:
        assert groups == (HEADS // n) // max(1, kv // n)  # local query heads per local KV head
        torch.testing.assert_close(parallel_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        assert set(pairs) == set(grads)
        for name, (got, want) in pairs.items():
            try:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the gradient of {name}")  # keeps torch's report of the mismatch
                raise
    specs = results[0][3]
    kv_specs = {k: s for k, s in specs.items() if isinstance(s, HeadShardSpec)}
    params = ("weight", "bias") if kv == 2 else ("weight",)  # kv == 2: the models with biases
    expected = {f"model.layers.{i}.self_attn.{p}_proj.{w}" for i in range(2) for p in "kv" for w in params}
    assert set(kv_specs) == (expected if kv != HEADS else set())
    for name, spec in specs.items():
        whole = spec.unshard([split[name] for *_, split, _, _ in results])
        try:
            torch.testing.assert_close(whole, grads[name], rtol=1e-4, atol=1e-6)
        except AssertionError as error:
            error.add_note(f"in the unsharded gradient of {name} ({spec})")
            raise


@pytest.mark.parametrize(("heads", "kv", "n"), [(6, 3, 2), (6, 2, 4), (12, 3, 2)])
def test_hf_llama_refuses_heads_that_do_not_split_before_communicating(heads: int, kv: int, n: int) -> None:
    model = _model(kv, heads=heads)
    numbers = rf"heads={heads}, kv_heads={kv}, tp={n}|heads={heads} is not divisible by tp={n}"
    with pytest.raises(ValueError, match=rf"self_attn \(attention\): .*({numbers})"):
        resolve_plan(model, LLAMA_PLAN, tp=n)  # no process group exists here


def _refused(rank: int) -> tuple[str, int, bool]:
    model = _model(3, heads=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CommMeter() as meter, pytest.raises(ValueError) as err:
        parallelize(model, plan=LLAMA_PLAN, mesh=Mesh(Topology(tp=2)))
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(err.value), meter.count(), same


def test_parallelize_refuses_kv_heads_on_every_rank_without_communicating() -> None:
    for message, calls, unchanged in run_threaded(2, _refused):
        assert message == (
            "model.layers.0.self_attn (attention): KV heads can neither be split nor replicated over tp "
            "(heads=6, kv_heads=3, tp=2): tp must divide kv_heads or be a multiple of it"
        )
        assert calls == 0 and unchanged


def test_importing_the_plans_does_not_import_transformers() -> None:
    code = "import sys, tessera.tensor_parallel as t; t.LLAMA_PLAN; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
