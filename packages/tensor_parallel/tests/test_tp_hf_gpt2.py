"""Optional (extra ``hf``): Hugging Face transformers' GPT-2, built from a config (nothing is
downloaded), converted by parallelize(GPT2_PLAN) on threaded ranks, equals the serial model.

HF's ``Conv1D`` layers store their weight as (in, out); their parallel versions hold the
nn.Linear layout (out, in), so the serial gradients of those are transposed for comparison.

Runs in ``hatch test`` (the hatch-test environment installs transformers) and ``hatch run
hf:test``; skipped, with the reason in the summary, where transformers is not installed.
Tolerances: the loss (~4.2) to rtol 1e-5, atol 1e-6, every gradient (up to ~0.3) to rtol
1e-4, atol 1e-6. fp32 round-off only: the parallel model sums row-parallel products and
the vocab-parallel softmax over ranks in another order; measured at tp 2 and 4, the loss is
off by ~5e-7 and no gradient by more than ~1e-7, while a missing reduction or a wrong shard
is off by the size of the gradient itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import GPT2_PLAN, parallelize, shard_of, vocab_parallel_cross_entropy

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: the HF GPT-2 plan is NOT tested "
    "(pip install 'tessera-tensor-parallel[hf]' to test it)",
)

VOCAB, SEQ = 64, 16


def _model() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,  # GPT-2's 50256 is outside this vocabulary
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _rank(
    rank: int, n: int, state: dict[str, Tensor], idx: Tensor, targets: Tensor, grads: dict[str, Tensor]
) -> Any:
    mesh = Mesh(Topology(tp=n))
    model = _model()
    model.load_state_dict(state)
    parallelize(model, plan=GPT2_PLAN, mesh=mesh)
    tied = model.lm_head.weight is model.transformer.wte.weight
    logits = model(idx).logits
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), mesh.group("tp"))
    loss.backward()
    pairs = {k: (p.grad, shard_of(model, k, grads[k])) for k, p in model.named_parameters()}
    return loss.detach(), tied, logits.shape[-1], pairs


@pytest.mark.parametrize("n", [2, 4])
def test_hf_gpt2_parallel_equals_serial(n: int) -> None:
    torch.manual_seed(0)
    serial = _model()
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    loss = F.cross_entropy(serial(idx).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {}
    for name, p in serial.named_parameters():  # in the serial layout (Conv1D: (in, out)): shard_of maps it
        assert p.grad is not None
        grads[name] = p.grad
    state = serial.state_dict()
    for parallel_loss, tied, local_vocab, pairs in run_threaded(n, _rank, n, state, idx, targets, grads):
        assert tied and local_vocab == VOCAB // n
        torch.testing.assert_close(parallel_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        assert set(pairs) == set(grads)
        for name, (got, want) in pairs.items():
            try:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the gradient of {name}")  # keeps torch's report of the mismatch
                raise
