"""Tier 1 (threaded ranks): Hugging Face Llama and GPT-2 with Megatron sequence parallelism.

HF models read the sequence length between their layers (positions, masks and rotary
embeddings from the embedding's output; GPT-2 reshapes by the whole sequence after its final
norm), so their plans keep the embedding's output whole (``vocab_whole``), split the
sequence at the first decoder layer (``sequence_start``) and gather it after the final norm
(``sequence_end``, then the head ``colwise_whole``; Llama's head gathers it itself).

Built from a config (random weights, nothing downloaded). Loss to rel 1e-5 and every
gradient shard to rtol 1e-4, atol 1e-6 against the serial model: fp32 round-off only (sums
over ranks in another order); a sequence shard read as another batch row, a norm gradient
left partial or summed twice is off by the size of the gradient (measured 0.13 before the
plans knew where HF reads the length).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import (
    GPT2_PLAN,
    LLAMA_PLAN,
    parallelize,
    shard_specs,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF SP NOT tested")

VOCAB, SEQ = 64, 16


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)  # type: ignore[no-any-return]


def _gpt2(tied: bool) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)  # type: ignore[no-any-return]


CASES: dict[str, tuple[Callable[[], nn.Module], object]] = {
    "llama": (_llama, LLAMA_PLAN),
    "gpt2": (lambda: _gpt2(False), GPT2_PLAN),
    "gpt2-tied": (lambda: _gpt2(True), GPT2_PLAN),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_hf_models_with_sequence_parallelism_follow_serial(name: str, tp: int) -> None:
    build, plan = CASES[name]
    torch.manual_seed(0)
    serial = build()
    state = serial.state_dict()
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    loss = F.cross_entropy(serial(idx).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    want = {n: p.grad for n, p in serial.named_parameters()}
    models = [build() for _ in range(tp)]  # built here: HF draws its init from the global RNG
    for m in models:
        m.load_state_dict(state)

    def rank(r: int) -> tuple[float, dict[str, torch.Tensor], dict[str, object]]:
        mesh = Mesh(Topology(tp=tp))
        group = mesh.group("tp")
        model = parallelize(models[r], plan=plan, mesh=mesh, sequence_parallel=True)  # type: ignore[arg-type]
        out = vocab_parallel_cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten(), group)
        out.backward()
        sync_sequence_parallel_grads(model, group)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return float(out.detach()), grads, dict(shard_specs(model))

    for r, (got_loss, grads, specs) in enumerate(run_threaded(tp, rank)):
        assert got_loss == pytest.approx(float(loss), rel=1e-5)
        assert set(grads) == set(want)
        for n, g in grads.items():
            spec = specs.get(n)
            expected = want[n] if spec is None else spec.shard(want[n], r, tp)  # type: ignore[attr-defined]
            torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6)
