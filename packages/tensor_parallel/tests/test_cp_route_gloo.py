"""Tier 2: context parallelism that finds attention without names (``route_attention``).

Models that call ``F.scaled_dot_product_attention`` where they like, with nothing named but
a learned position embedding: ``Llamaish`` (GQA, 2 of 4 KV heads, repeated inline; a rotary
module inside each attention, autodetected), ``GPT2ish`` (learned positions, ``wpe``
named), and Hugging Face Llama (GQA 2 of 4, its rotary module autodetected, SDPA through its
attention interface with ``enable_gqa``) and GPT-2 (built with ``eager`` attention, switched
to ``sdpa``; its ``wpe`` autodetected), from configs. At cp=2 under ring (contiguous and
zigzag) and Ulysses (zigzag) each rank's loss (the exact global mean) and every gradient
(summed over cp) are compared with the serial model's on the full sequence.

Tolerance, fp32: loss rtol 1e-6 / atol 1e-5 and gradients rtol 1e-5 / atol 1e-6. The
loss is a sum of 2 ranks' partial sums; attention is merged over K/V blocks by log-sum-exp
(ring) or computed on another layout (Ulysses) and parameter gradients are sums of 2
partial sums: all fp32 round-off, measured: losses (~4.2) <= 4.8e-7, gradients <= 1.2e-7
on gradients up to ~0.3. Positions
that do not follow the shards, a lost mask or an unsummed gradient are off by > 1e-3
(``test_positions_that_do_not_follow_are_caught`` shows the size of the first).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.models.foreign import ForeignConfig, GPT2ish, Llamaish
from tessera.tensor_parallel.context import (
    context_parallel_loss,
    route_attention,
    split_batch,
    sync_context_parallel_grads,
)

VOCAB, SEQ, BATCH = 64, 16, 2
MODES = [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag")]
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-5}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _hf_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _hf_gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "llamaish":
        return Llamaish(ForeignConfig(vocab=VOCAB, dim=32, hidden=48, max_len=SEQ), seed=0)
    if name == "gpt2ish":
        return GPT2ish(ForeignConfig(vocab=VOCAB, dim=32, hidden=48, max_len=SEQ), seed=0)
    return _hf_llama() if name == "hf-llama" else _hf_gpt2()


POSITIONS = {"gpt2ish": "wpe"}


def batch() -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _logits(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits  # type: ignore[no-any-return]


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def serial(name: str) -> tuple[float, dict[str, Tensor]]:
    model = build(name)
    ids, targets = batch()
    loss = F.cross_entropy(_logits(model(ids)).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.item(), _grads(model)


def _parallel(rank: int, name: str) -> list[tuple[float, dict[str, Tensor]]]:
    out = []
    for mode, layout in MODES:
        model = route_attention(build(name), None, mode=mode, layout=layout, positions=POSITIONS.get(name))
        ids, targets = split_batch(*batch(), group=None, layout=layout)
        loss = context_parallel_loss(_logits(model(ids)), targets, None)
        loss.backward()
        sync_context_parallel_grads(model, None)
        out.append((loss.item(), _grads(model)))
    return out


@pytest.mark.parametrize("name", ["llamaish", "gpt2ish", "hf-llama", "hf-gpt2"])
def test_routed_attention_trains_like_serial(worker_pools: PoolFactory, name: str) -> None:
    """Ring contiguous, ring zigzag, Ulysses zigzag at cp=2: loss and every gradient."""
    if name.startswith("hf"):
        pytest.importorskip("transformers", reason="transformers is not installed: HF models NOT tested")
    want_loss, want = serial(name)
    for per_rank in worker_pools(2).run(_parallel, name, timeout=180):
        for loss, grads in per_rank:
            torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), **LOSS_TOL)
            assert grads.keys() == want.keys()
            for key, g in want.items():
                torch.testing.assert_close(grads[key], g, **TOL)


def _unfollowed(rank: int) -> tuple[float, dict[str, Tensor]]:
    """Llamaish with its rotary modules left on local positions (the hooks removed)."""
    model = route_attention(build("llamaish"), None, mode="ring", layout="zigzag", positions=None)
    for layer in model.layers:  # type: ignore[union-attr]
        layer.attn.rope._forward_pre_hooks.clear()
        layer.attn.rope._forward_hooks.clear()
    ids, targets = split_batch(*batch(), group=None, layout="zigzag")
    loss = context_parallel_loss(_logits(model(ids)), targets, None)
    loss.backward()
    sync_context_parallel_grads(model, None)
    return loss.item(), _grads(model)


def test_positions_that_do_not_follow_are_caught(worker_pools: PoolFactory) -> None:
    """What the equivalence above would see if rotary positions did not follow the shards."""
    want_loss, want = serial("llamaish")
    for loss, grads in worker_pools(2).run(_unfollowed):
        assert abs(loss - want_loss) > 1e-4  # 10x LOSS_TOL's atol
        assert max(float((grads[k] - g).abs().max()) for k, g in want.items()) > 1e-3
