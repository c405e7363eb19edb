"""A model built without parameter storage, materialized by each rank for its own part.

``deferred_parameters()`` builds ``Llamaish`` (rotary tables as buffers, RMSNorm ``scale``
without ``reset_parameters``: given an ``init``), ``GPT2ish`` (the head tied to the token
embedding), a Hugging Face Llama and GPT-2 (its head tied, Conv1D layers) from config
(their ``_init_weights``), the reference GPT with a mixture of experts in every layer and
a user's own mixture (``Mixish``: a router and a list of experts, which ``boost`` converts to
``tessera.moe.MoE`` and whose stacked banks it makes from the user's per-expert layers) and a
Hugging Face Mixtral (its sparse MoE blocks converted by ``boost``, each bank made from the
fused ``experts.gate_up_proj`` / ``down_proj`` that HF's ``_init_weights`` draws; Llama 4's by
columns and GPT-OSS's alternating, with biases, are read the same way) and
further layouts of transformers' mixtures (Nemotron-H's experts not gated, DBRX's flat, Aria's
by columns, LongCat-Flash's identity experts, AXK1's post-norm, Kolibri's and LFM2's router
biases, MiniMax-M3's limited SwiGLU; built as ``tessera.launcher.testing_hf_moe`` builds them),
with every parameter on the meta device. ``boost`` materializes what the rank holds after
tensor parallelism (1D, Megatron SP, 2D, 2.5D, 3D), expert parallelism and the pipeline
cut. The result must equal the same model built eagerly and initialized by
``init_by_name`` with the same seed, element for element (``torch.equal``: each value is
computed once, on the host, the same way, and sliced; no arithmetic differs), and the first
training losses must equal those of the eager model boosted the same way (exactly: the
same layout runs the same operations).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.config.main_config import MoEConfig
from tessera.launcher.job.moe_model import MOE_GPT_PLAN, moe_gpt
from tessera.launcher.testing_hf_moe import tiny_moe_class, tiny_moe_config
from tessera.launcher.train.deferred import deferred_parameters, init_by_name
from tessera.models import GPT2ISH_ROLES, LLAMAISH_ROLES, ForeignConfig, GPT2ish, GPTConfig, Llamaish
from tessera.models.foreign_moe import MixConfig, Mixish

VOCAB, SEQ, BATCH, SEED = 64, 16, 8, 11
# transformers' MoE families by their bank and router kinds: not gated and per expert
# (Nemotron-H), flat (DBRX), by columns (Aria), identity experts (LongCat-Flash), a post-norm
# (AXK1), a router bias on the block (Kolibri, LFM2), a SwiGLU with limits (MiniMax-M3), a norm per
# expert (Ergo), shared experts weighed by the router (Inkling); ERNIE's
# score bias is a parameter, refused deferred (hf_moe_conversion: the router holds a buffer)
MOE_FAMILIES = [
    "nemotron_h", "dbrx", "aria_text", "longcat_flash", "axk1", "kolibri1", "lfm2_moe",
    "minimax_m3_vl_text", "ergo", "inkling_text", "gemma4_text", "deepseek_v4",
]  # fmt: skip
LIMITS = {  # widths of their own, small
    "nemotron_h": {"moe_shared_expert_intermediate_size": 24, "layers_block_type": ["full_attention", "moe"]},
    "minimax_m3_vl_text": {
        "swiglu_limit": 0.5,
        "shared_intermediate_size": 24,
        "dense_intermediate_size": 24,
    },
}
SIZES = ForeignConfig(vocab=VOCAB, dim=64, heads=4, kv_heads=2, layers=2, hidden=96)
ROLES = LLAMAISH_ROLES


def init(name: str, module: nn.Module) -> None:
    """A user's init: the layers' own, RMSNorm gains at 1 plus a little noise (so a wrong
    slice or a lost value shows)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        for p in module.parameters(recurse=False):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape))


def _build(kind: str, deferred: bool) -> nn.Module:
    def make() -> nn.Module:
        if kind == "llamaish":
            return Llamaish(SIZES, seed=0)
        if kind == "llamaish-frozen":  # fine-tuning: the embedding and one attention frozen
            model = Llamaish(SIZES, seed=0)
            for name in ("tok_embeddings", "layers.0.attn"):
                model.get_submodule(name).requires_grad_(False)
            return model
        if kind == "gpt2ish":
            return GPT2ish(SIZES, seed=0)
        if kind == "mixish":  # a user's own mixture (router + a list of experts), converted by boost()
            return Mixish(MixConfig(base=dataclasses.replace(SIZES, dim=32, hidden=24), shared=8), seed=0)
        if kind == "moe-gpt":  # every MLP a mixture of 4 experts, top 2, no token dropped
            cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2)
            return moe_gpt(cfg, MoEConfig(enabled=True, experts=4, top_k=2, dropless=True), seed=0)
        import transformers

        if kind.startswith("hf-moe:"):  # a family of transformers' MoE families, as the tests build it
            family = kind.removeprefix("hf-moe:")
            return tiny_moe_class(family)(tiny_moe_config(family, LIMITS.get(family)))
        if kind == "hf-mixtral":  # boost() converts its sparse MoE blocks, their banks made by HF's init
            mixtral = transformers.MixtralConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=None,
            )  # fmt: skip
            return transformers.MixtralForCausalLM(mixtral)
        if kind == "hf-llama4":  # top-1 sigmoid, experts by columns, a shared expert
            llama4 = transformers.Llama4TextConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=SEQ,
                bos_token_id=0, eos_token_id=0, pad_token_id=None,
            )  # fmt: skip
            return transformers.Llama4ForCausalLM(llama4)
        if kind == "hf-gpt-oss":  # gate and up alternating in the columns, biases, a router bias
            gpt_oss = transformers.GptOssConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=SEQ, sliding_window=4,
                bos_token_id=0, eos_token_id=0, pad_token_id=None,
            )  # fmt: skip
            return transformers.GptOssForCausalLM(gpt_oss)
        if kind == "hf-gpt2":  # the head tied to the token embedding; no dropout (both runs draw alike)
            gpt2 = transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            )  # fmt: skip
            return transformers.GPT2LMHeadModel(gpt2)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, pad_token_id=None,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    if not deferred:
        return make()
    with deferred_parameters():
        return make()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _run(rank: int, kind: str, deferred: bool, config: Config) -> tuple[dict[str, Tensor], list[float]]:
    model = _build(kind, deferred)
    fn = None if kind.startswith("hf-") else init
    if not deferred:
        init_by_name(model, SEED, fn)
    else:
        assert all(p.is_meta for p in model.parameters())
    plan = {
        "llamaish": ROLES,
        "llamaish-frozen": ROLES,
        "gpt2ish": GPT2ISH_ROLES,
        "moe-gpt": MOE_GPT_PLAN,
    }.get(kind)
    with boost(model, torch.optim.SGD(model.parameters(), lr=0.5), config, plan=plan, init=fn) as engine:
        weights = {n: t.clone() for n, t in engine.full_state_dict().items()}
        losses = [engine.train_step(*_batch(step)).loss for step in range(2)]
    return weights, losses


def _config(parallel: ParallelConfig, **zero: Any) -> Config:
    c = Config(parallel=parallel, zero=ZeroConfig(**zero), train=TrainConfig(precision="fp32", seed=SEED))
    return dataclasses.replace(c, data=dataclasses.replace(c.data, batch_size=BATCH))


P = ParallelConfig
CASES = {
    "llamaish-tp2": ("llamaish", P(tp=2), {}),
    "llamaish-pp2": ("llamaish", P(pp=2, microbatches=2, schedule="1f1b"), {}),
    "llamaish-dp2-zero3": ("llamaish", P(dp=2), {"stage": 3}),
    "llamaish-dp2-zero2-disk": ("llamaish", P(dp=2), {"stage": 2, "disk_dir": "DISK", "chunk_numel": 512}),
    "llamaish-dp2-zero3-disk": (
        "llamaish",
        P(dp=2),
        {"stage": 3, "disk_dir": "DISK", "host_budget_mb": 0.01},
    ),
    "hf-llama-dp2-zero3-disk": ("hf-llama", P(dp=2), {"stage": 3, "disk_dir": "DISK", "chunk_numel": 256}),
    "llamaish-pp2-tp2": ("llamaish", P(pp=2, tp=2, microbatches=2, schedule="1f1b"), {}),
    "gpt2ish-tied-tp2": ("gpt2ish", P(tp=2), {}),
    "gpt2ish-tied-dp2-zero3": ("gpt2ish", P(dp=2), {"stage": 3}),
    "hf-llama-tp2": ("hf-llama", P(tp=2), {}),
    "hf-gpt2-tp2": ("hf-gpt2", P(tp=2), {}),
    "hf-gpt2-pp2": ("hf-gpt2", P(pp=2, microbatches=2, schedule="1f1b"), {}),
    "hf-gpt2-dp2-zero3-disk": ("hf-gpt2", P(dp=2), {"stage": 3, "disk_dir": "DISK", "chunk_numel": 256}),
    "llamaish-tp2-megatron-sp": ("llamaish", P(tp=2, sequence_parallel=True), {}),
    "llamaish-2d": ("llamaish", P(tp=4, tp_mode="2d", microbatches=1), {}),
    "gpt2ish-tied-2d-dp2-zero3": ("gpt2ish", P(dp=2, tp=4, tp_mode="2d", microbatches=1), {"stage": 3}),
    "llamaish-2.5d": ("llamaish", P(tp=8, tp_mode="2.5d", tp_depth=2, microbatches=1), {}),
    "moe-gpt-dp2-ep2": ("moe-gpt", P(dp=2, ep=2), {}),
    "moe-gpt-dp2-ep2-tp2-megatron-sp": ("moe-gpt", P(dp=2, ep=2, tp=2, sequence_parallel=True), {}),
    "moe-gpt-dp4-ep2-zero3": ("moe-gpt", P(dp=4, ep=2, microbatches=1), {"stage": 3}),
    "gpt2ish-tied-3d": ("gpt2ish", P(tp=8, tp_mode="3d", microbatches=1), {}),
    "own-moe-dp2-ep2": ("mixish", P(dp=2, ep=2), {}),
    "own-moe-dp2-ep2-zero3": ("mixish", P(dp=2, ep=2, microbatches=2), {"stage": 3}),
    "hf-mixtral-dp2-ep2": ("hf-mixtral", P(dp=2, ep=2), {}),
    "hf-mixtral-dp2-ep2-zero3": ("hf-mixtral", P(dp=2, ep=2, microbatches=2), {"stage": 3}),
    "llamaish-frozen-dp2-tp2-zero3": ("llamaish-frozen", P(dp=2, tp=2), {"stage": 3}),
    # each mixture's experts split over the whole 2D grid (its input gathered whole), and over ep
    "moe-gpt-dp2-ep2-2d": ("moe-gpt", P(dp=2, ep=2, tp=4, tp_mode="2d", microbatches=1), {}),
    "hf-mixtral-3d-zero3": ("hf-mixtral", P(tp=8, tp_mode="3d", microbatches=1), {"stage": 3}),
    "hf-llama4-dp2-ep2": ("hf-llama4", P(dp=2, ep=2), {}),
    "hf-gpt-oss-dp2-ep2-zero3": ("hf-gpt-oss", P(dp=2, ep=2, microbatches=2), {"stage": 3}),
    # further layouts of expert banks and routers, each made from what HF's _init_weights draws
    **{f"hf-moe:{f}-dp2-ep2": (f"hf-moe:{f}", P(dp=2, ep=2, microbatches=1), {}) for f in MOE_FAMILIES},
    "hf-moe:nemotron_h-dp2-ep2-zero3": ("hf-moe:nemotron_h", P(dp=2, ep=2, microbatches=1), {"stage": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deferred_equals_eager(worker_pools: PoolFactory, tmp_path: Any, case: str) -> None:
    kind, parallel, zero = CASES[case]
    if kind.startswith("hf-"):
        pytest.importorskip("transformers")
    zero = {k: (str(tmp_path / "chunks") if v == "DISK" else v) for k, v in zero.items()}
    config = _config(parallel, **zero)
    pool = worker_pools(config.world_size)
    eager = pool.run(_run, kind, False, config, timeout=180)
    deferred = pool.run(_run, kind, True, config, timeout=180)
    for rank, ((want, want_losses), (got, got_losses)) in enumerate(zip(eager, deferred, strict=True)):
        assert got.keys() == want.keys(), f"rank {rank}: {sorted(got.keys() ^ want.keys())}"
        wrong = [n for n in want if not torch.equal(got[n], want[n])]
        assert not wrong, f"rank {rank}: deferred values differ from eager for {wrong}"
        assert got_losses == want_losses, f"rank {rank}: {got_losses} != {want_losses}"


def test_parameters_are_meta_and_buffers_real() -> None:
    with deferred_parameters():
        model = Llamaish(SIZES, seed=0)
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the context is over


def _refused(rank: int, config: Config) -> str:
    with deferred_parameters():
        model = Llamaish(SIZES, seed=0)
    try:
        boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config, plan=ROLES)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_a_module_without_an_init_is_refused_by_name(worker_pools: PoolFactory) -> None:
    got = worker_pools(2).run(_refused, _config(P(tp=2)))[0]
    assert "(RMSNorm) holds parameters scale but has no reset_parameters()" in got, got


def test_init_by_name_is_reproducible_and_differs_by_seed() -> None:
    a, b, c = (init_by_name(Llamaish(SIZES, seed=s), seed, init) for s, seed in ((0, 1), (5, 1), (0, 2)))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.output.weight, c.output.weight)
    loss = F.cross_entropy(a(_batch(0)[0]).flatten(0, 1), _batch(0)[1].flatten())
    assert 3.0 < float(loss) < 6.0  # a sensible initial loss near log(64)
