"""Tier 1: one plan of roles serves 2D, 2.5D and 3D for models that are not the reference GPT.

``tessera.models.foreign.Llamaish`` (RMSNorm with its weight called ``scale``, rotary inside
attention, SwiGLU, grouped-query attention with 2 KV heads of 4) and ``GPT2ish`` (LayerNorm,
biases, a fused q|k|v Linear, learned positions ``wpe``, the head tied to ``wte``), each with
one role plan written here (their module names match no built-in plan), translated by
``plan_for_mode`` to 2D (q=2, tp=4), 2.5D (q=2, d=2, tp=8) and 3D (q=2, tp=8) on threaded
ranks (and ``Llamaish`` with a user's own LoRA layers on every projection), trained a few SGD
steps against the serial model: the loss of every step, every
first-step gradient (split ones gathered by the recorded shard specs, whole ones after
``sync_sequence_parallel_grads``) and the final weights.

Tolerances (fp32): losses ``rtol=1e-5``; gradients ``rtol=1e-4``, ``atol=1e-5`` times the
largest serial gradient of that parameter (floored at 1e-2); weights ``rtol=1e-5``,
``atol=1e-6``. The parallel model adds the same products in another order (SUMMA / 3D partial
sums over the grid's lines, per-row norm statistics, reduce-scattered weight gradients) through
two layers and the loss: a few ulps per layer, far below what a lost or doubled contribution
would show (the size of a gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, all_gather
from tessera.comm.testing import run_threaded
from tessera.models.foreign import GPT2ISH_ROLES as GPT2ISH
from tessera.models.foreign import LLAMAISH_ROLES as LLAMAISH
from tessera.models.foreign import ForeignConfig, GPT2ish, Llamaish
from tessera.models.low_rank import with_low_rank
from tessera.tensor_parallel import (
    GPT2_PLAN,
    LLAMA_PLAN,
    PHI3_PLAN,
    Cube3D,
    Grid2D,
    Grid2p5D,
    Plan,
    batch_block,
    batch_block_2p5d,
    cross_entropy_2d,
    cross_entropy_2p5d,
    cross_entropy_3d,
    parallelize,
    shard_specs,
    sync_sequence_parallel_grads,
)
from tessera.tensor_parallel.modes import plan_for_mode
from tessera.tensor_parallel.three_d import batch_block as batch_block_3d

CFG = ForeignConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, hidden=64, max_len=16)
BATCH, SEQ, STEPS, LR = 4, 8, 3, 0.5

LLAMAISH_ROLES = Plan.of(LLAMAISH, name="llamaish")
GPT2ISH_ROLES = Plan.of(GPT2ISH, name="gpt2ish")


def _seeded(model: nn.Module) -> nn.Module:
    """``model`` with weights from a private generator (ranks are threads: the global one is
    shared); norms near 1, biases and matrices small and nonzero."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _hf_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers missing: HF Llama NOT tested")
    config = transformers.LlamaConfig(
        vocab_size=CFG.vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return _seeded(transformers.LlamaForCausalLM(config))


def _hf_phi3(kv: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers missing: HF Phi3 NOT tested")
    config = transformers.Phi3Config(
        vocab_size=CFG.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=SEQ,
        pad_token_id=None, bos_token_id=1, eos_token_id=2,  # no padding_idx: nD embeddings refuse one
    )  # fmt: skip
    return _seeded(transformers.Phi3ForCausalLM(config))


def _hf_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers missing: HF GPT-2 NOT tested")
    config = transformers.GPT2Config(
        vocab_size=CFG.vocab, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return _seeded(transformers.GPT2LMHeadModel(config))


MODELS: dict[str, tuple[Callable[[], nn.Module], Plan]] = {
    "llamaish": (lambda: Llamaish(CFG, seed=0), LLAMAISH_ROLES),
    "gpt2ish": (lambda: GPT2ish(CFG, seed=0), GPT2ISH_ROLES),
    "hf-llama": (_hf_llama, LLAMA_PLAN),
    "hf-gpt2": (_hf_gpt2, GPT2_PLAN),
    "hf-phi3": (_hf_phi3, PHI3_PLAN),  # fused q|k|v (4 KV heads of 4) and gate|up
    # a user's own LoRA layers on every projection: lora_A and lora_B split as two more linears
    "llamaish-lora": (
        lambda: with_low_rank(Llamaish(CFG, seed=0), ("wq", "wk", "wv", "wo", "w1", "w2", "w3")),
        LLAMAISH_ROLES,
    ),
}


def _logits(model: nn.Module, idx: Tensor) -> Tensor:
    if isinstance(model, Llamaish | GPT2ish):
        return model(idx)  # type: ignore[no-any-return]
    return model(idx, use_cache=False).logits  # type: ignore[no-any-return]


def _loss(model: nn.Module, idx: Tensor, targets: Tensor, mesh: Mesh) -> Tensor:
    """The global mean loss: this rank's batch block in, the mode's exact cross-entropy."""
    mode = mesh.topology.tp_mode.value
    if mode == "2d":
        grid = Grid2D.from_mesh(mesh)
        return cross_entropy_2d(_logits(model, batch_block(idx, grid)), batch_block(targets, grid), grid)
    if mode == "2.5d":
        tess = Grid2p5D.from_mesh(mesh)
        logits = _logits(model, batch_block_2p5d(idx, tess))
        return cross_entropy_2p5d(logits, batch_block_2p5d(targets, tess), tess)
    cube = Cube3D.from_mesh(mesh)
    logits = _logits(model, batch_block_3d(idx, cube))
    return cross_entropy_3d(logits, batch_block_3d(targets, cube, branch=True), cube)


MODES = {
    "2d": dict(tp=4, tp_mode="2d"),
    "2.5d": dict(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d": dict(tp=8, tp_mode="3d"),
}

Curve = tuple[list[float], dict[str, Tensor], dict[str, Tensor]]


def _batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _serial(make: Callable[[], nn.Module]) -> Curve:
    model, (idx, targets) = make(), _batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(_logits(model, idx).flatten(0, 1), targets.flatten())
        torch.autograd.backward(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _gathered(model: nn.Module, tensors: dict[str, Tensor], mesh: Mesh) -> dict[str, Tensor]:
    specs, group, tp = shard_specs(model), mesh.group("tp"), mesh.size("tp")
    out = {}
    for n, t in tensors.items():
        spec = specs.get(n)
        if spec is None:
            out[n] = t
        else:
            out[n] = spec.unshard(all_gather(t.contiguous(), group, spec.local_dim).chunk(tp, spec.local_dim))
    return out


def _parallel(rank: int, model_name: str, mode: str) -> Curve:
    make, roles = MODELS[model_name]
    topology = Topology(**MODES[mode])  # type: ignore[arg-type]
    mesh = Mesh(topology)
    model = make()
    model = parallelize(
        model, plan=plan_for_mode(roles, topology.tp_mode, model, depth=topology.tp_depth), mesh=mesh
    )
    idx, targets = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, idx, targets, mesh)
        torch.autograd.backward(loss)
        sync_sequence_parallel_grads(model, mesh.group("tp"))
        if step == 0:
            grads = _gathered(
                model, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, mesh
            )
        opt.step()
        losses.append(loss.item())
    return losses, grads, _gathered(model, {n: p.detach() for n, p in model.named_parameters()}, mesh)


def _compare(serial: Curve, ranks: list[Curve]) -> None:
    losses, grads, weights = serial
    for got_losses, got_grads, got_weights in ranks:
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=0.0)
        assert set(got_grads) == set(grads)
        for n, want in grads.items():
            scale = max(want.abs().max().item(), 1e-2)
            torch.testing.assert_close(got_grads[n], want, rtol=1e-4, atol=1e-5 * scale)
        for n, want in weights.items():
            torch.testing.assert_close(got_weights[n], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("model_name", "mode"),
    [(m, mode) for m in ("llamaish", "gpt2ish") for mode in MODES]
    + [("llamaish-lora", mode) for mode in MODES]
    + [("hf-llama", "2d"), ("hf-gpt2", "2d"), ("hf-phi3", "2d")],
)
def test_role_plan_follows_serial(model_name: str, mode: str) -> None:
    if model_name.startswith("hf-"):  # skip before the ranks start: a rank's skip logs as its traceback
        pytest.importorskip("transformers", reason=f"transformers missing: {model_name} NOT tested")
    out: list[Any] = run_threaded(MODES[mode]["tp"], _parallel, model_name, mode)  # type: ignore[arg-type]
    _compare(_serial(MODELS[model_name][0]), out)


def test_refusals_name_the_entry_role_mode_and_numbers_before_anything_changes() -> None:
    from tessera.tensor_parallel import resolve_plan

    gqa = Llamaish(dataclasses.replace(CFG, kv_heads=1), seed=0)
    before = {n: p.clone() for n, p in gqa.state_dict().items()}
    with pytest.raises(ValueError, match=r"heads=4, kv_heads=1, q=2"):
        resolve_plan(gqa, plan_for_mode(LLAMAISH_ROLES, "2d", gqa), tp=4)
    assert all(torch.equal(before[n], p) for n, p in gqa.state_dict().items())
    gathered = Plan.of({**LLAMAISH_ROLES.as_dict(), "output": "colwise_gather"})
    with pytest.raises(ValueError, match=r"'output': role 'colwise_gather' cannot be served by tp mode 3d"):
        plan_for_mode(gathered, "3d", gqa)


def test_a_colwise_lm_head_is_read_as_head_and_keeps_its_tie() -> None:
    model = GPT2ish(CFG, seed=0)
    plan = plan_for_mode(Plan.of({**GPT2ISH_ROLES.as_dict(), "head": "colwise"}), "2d", model)
    assert plan.as_dict()["head"].name == "2d_tied_head"
    assert plan_for_mode(LLAMAISH_ROLES, "2d", Llamaish(CFG)).as_dict()["output"].name == "2d_head"


def test_a_module_with_parameters_and_no_role_is_refused_in_nd() -> None:
    model = Llamaish(CFG, seed=0)
    plan = Plan.of({k: v for k, v in LLAMAISH_ROLES.as_dict().items() if not k.endswith("norm")})
    with pytest.raises(ValueError, match=r"layers.0.attn_norm \(RMSNorm\) holds parameters but no"):
        plan_for_mode(plan, "2d", model)
    assert plan_for_mode(plan, "1d", model) is plan  # 1D: the roles are its styles


def test_a_fused_qkv_of_grouped_kv_heads_is_refused_in_nd() -> None:
    from tessera.tensor_parallel import resolve_plan

    pytest.importorskip("transformers", reason="transformers missing: HF Phi3 NOT tested")
    gqa = _hf_phi3(kv=2)
    with pytest.raises(
        ValueError, match=r"self_attn \(2d_attention\): qkv_proj is a fused q\|k\|v of grouped KV"
    ):
        resolve_plan(gqa, plan_for_mode(PHI3_PLAN, "2d", gqa), tp=4)
