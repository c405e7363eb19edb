"""Models Tessera's authors never wrote, through boost(): a user's own Llama-style model and
Hugging Face GPT-2 and Llama (built from a config, random weights, nothing downloaded).

Each composition trains a few SGD steps on the worker pool and is compared with the same
model trained serially (plain PyTorch: forward, mean cross-entropy, backward, SGD). Bounds:
losses rel 1e-5 (a mean over the batch's token losses in fp32, summed in another order by tp,
dp and microbatches) and the consolidated weights atol 1e-6 + rtol 1e-5 (SGD with momentum is
linear in the gradient, so the weights stay at round-off; measured at most ~1e-8 here). A
wrong shard, a lost gradient contribution or a block run out of order is off by the size of
an update.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ModelSpec, ParallelConfig, boost
from tessera.launcher.families.spec import HoldingBlock, check_blocks, pipeline_blocks, tied_blocks
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    assert_matches_serial,
    boosted_run,
    logits_of,
    oracle_config,
    serial_run,
    sgd,
)
from tessera.tensor_parallel import Plan, Style

VOCAB, SEQ, BATCH, STEPS, LR = 64, 16, 8, 3, 0.5
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


# ---------------------------------------------------------------------------- a user's model
class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, 8).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # type: ignore[no-any-return]


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm_a, self.attention = RMSNorm(d), SelfAttention(d, 4)
        self.norm_b, self.ffn = RMSNorm(d), SwiGLU(d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm_a(x))
        return x + self.ffn(self.norm_b(x))


class TinyLlama(nn.Module):
    """Its layers are an nn.ModuleList attribute called ``blocks``; no ``blocks()`` method."""

    def __init__(self, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Layer(d) for _ in range(layers))
        self.final_norm = RMSNorm(d)
        self.out = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tokens(ids)
        for layer in self.blocks:
            h = layer(h)
        return self.out(self.final_norm(h))  # type: ignore[no-any-return]


TINY_PLAN = Plan.of(
    {
        "tokens": Style.VOCAB,
        "blocks.*.attention": Style.ATTENTION,
        "blocks.*.attention.wq": Style.COLWISE,
        "blocks.*.attention.wk": Style.COLWISE,
        "blocks.*.attention.wv": Style.COLWISE,
        "blocks.*.attention.wo": Style.ROWWISE,
        "blocks.*.ffn": Style.REGION,
        "blocks.*.ffn.gate": Style.COLWISE,
        "blocks.*.ffn.up": Style.COLWISE,
        "blocks.*.ffn.down": Style.ROWWISE,
        "out": Style.COLWISE,
    },
    name="tiny-llama",
)


# ---------------------------------------------------------------------------- Hugging Face
def _hf_gpt2(tied: bool = False) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _hf_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class Spare(TinyLlama):
    """A parameter of its own that its forward never uses (as Inkling 2 Loop's message queries
    when it makes one pass): in no pipeline block, so the first block holds it
    (``spec.HoldingBlock``), and its stage saves and exports it."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Parameter(torch.randn(4))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "tiny": TinyLlama,
    "tiny-spare": Spare,
    "gpt2": _hf_gpt2,
    "gpt2-tied": lambda: _hf_gpt2(tied=True),  # GPT-2's default: LM head = token embedding
    "llama": _hf_llama,
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name]()


def _parallel(rank: int, name: str, config: Config) -> Run:
    spec = ModelSpec(plans={"1d": TINY_PLAN}) if name == "tiny" else None
    example = TOKENS.at(0)[0][:2]
    return boosted_run(_build(name), TOKENS.first(STEPS), config, sgd(LR), spec=spec, example=example)


CASES = [
    (ParallelConfig(tp=2), 0),
    (ParallelConfig(tp=2, sequence_parallel=True), 0),  # the plans name no norm: found and summed
    (ParallelConfig(pp=2, tp=2, microbatches=2, schedule="1f1b", sequence_parallel=True), 1),
    (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
    (ParallelConfig(dp=2), 3),
    (ParallelConfig(dp=2, pp=2, tp=2, microbatches=2, schedule="1f1b"), 1),
]


def _id(c: Any) -> str:
    if isinstance(c, ParallelConfig):
        return f"dp{c.dp}-pp{c.pp}-tp{c.tp}" + ("-sp" if c.sequence_parallel else "")
    return f"zero{c}" if isinstance(c, int) else str(c)


@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-tied", "llama"])
@pytest.mark.parametrize(("parallel", "zero"), CASES, ids=_id)
def test_a_model_tessera_never_saw_follows_its_serial_run(
    worker_pools: PoolFactory, name: str, parallel: ParallelConfig, zero: int
) -> None:
    if name != "tiny":
        pytest.importorskip("transformers", reason="transformers is not installed: HF models NOT tested")
    config = oracle_config(parallel, zero, batch_size=BATCH)
    assert config.validate() == []
    results = worker_pools(config.world_size).run(_parallel, name, config, timeout=180)
    assert_matches_serial(results, serial_run(_build(name), TOKENS.first(STEPS), sgd(LR)))


# ---------------------------------------------------------------------------- refusals, no ranks
class Scaled(TinyLlama):
    """Its forward scales the embedding: not the chain of its children."""

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tokens(ids) * 2.0
        for layer in self.blocks:
            h = layer(h)
        return self.out(self.final_norm(h))  # type: ignore[no-any-return]


def test_blocks_are_found_and_checked_against_the_model() -> None:
    model = TinyLlama()
    blocks = pipeline_blocks(model, ModelSpec())
    assert blocks == [model.tokens, *model.blocks, model.final_norm, model.out]
    check_blocks(model, blocks, TOKENS.at(0)[0], logits_of)
    scaled = Scaled()
    with pytest.raises(ValueError, match=r"do not reproduce model\(example\): largest difference"):
        check_blocks(scaled, pipeline_blocks(scaled, ModelSpec()), TOKENS.at(0)[0], logits_of)


def test_a_parameter_no_block_uses_is_held_by_the_first_block() -> None:
    model = Spare()
    blocks = pipeline_blocks(model, ModelSpec())
    assert isinstance(blocks[0], HoldingBlock) and blocks[0].block is model.tokens
    assert list(blocks[0].held) == [model.spare]
    assert blocks[1:] == [*model.blocks, model.final_norm, model.out]
    check_blocks(model, blocks, TOKENS.at(0)[0], logits_of)


def test_a_parameter_no_block_uses_is_kept_by_a_pipeline(worker_pools: PoolFactory) -> None:
    """pp=2 (1F1B): the unused parameter is on the first stage, unchanged (no gradient), and the
    run equals the serial one, every parameter included (a parameter no stage held was lost)."""
    config = oracle_config(ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, "tiny-spare", config, timeout=180)
    merged = assert_matches_serial(results, serial_run(_build("tiny-spare"), TOKENS.first(STEPS), sgd(LR)))
    torch.testing.assert_close(merged["spare"], _build("tiny-spare").spare, rtol=0, atol=0)


def test_a_weight_tied_across_blocks_is_found_with_its_blocks() -> None:
    """The embedding and LM head sharing one weight (the pipeline then sums the gradients of
    its copies on the first and last stage's ranks: the gpt2-tied cases above)."""
    model = TinyLlama()
    model.out.weight = model.tokens.weight
    tied = tied_blocks(pipeline_blocks(model, ModelSpec()))
    assert list(tied.values()) == [[0, 5]] and next(iter(tied)) is model.tokens.weight


def test_a_model_without_layers_or_plan_gets_one_line() -> None:
    with pytest.raises(ValueError, match=r"no nn.ModuleList of layers; pass ModelSpec\(blocks=fn\)"):
        pipeline_blocks(nn.Sequential(nn.Linear(2, 2)), ModelSpec())
    from tessera.comm import TPMode

    with pytest.raises(ValueError, match=r"no tensor-parallel plan for TinyLlama in mode 2d \(plans: 1d\)"):
        ModelSpec(plans={"1d": TINY_PLAN}).plan(TPMode.TWO_D, TinyLlama())


def _train_and_export(rank: int, config: Config, path: str) -> None:
    model = _build("llama")
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    engine.train_step(*TOKENS.at(0))
    engine.consolidate(path)
    engine.mesh.close()


def _import_and_eval(rank: int, config: Config, path: str) -> float:
    torch.manual_seed(1)  # other weights than the exported ones: the import must replace them
    model = BUILDERS["llama"]()
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    engine.import_weights(path)
    loss = engine.eval_loss(*TOKENS.at(1))
    engine.mesh.close()
    return loss


def test_hf_llama_exports_hf_names_and_imports_under_another_topology(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """Trained by dp2 x pp2 x tp2 and consolidated to one safetensors file, the weights load
    into a plain ``LlamaForCausalLM`` by its own names (strict), and import into a tp2 x dp2
    engine whose next loss equals that model's (rel 1e-5: fp32, another summation order)."""
    pytest.importorskip("transformers", reason="transformers is not installed: HF models NOT tested")
    import safetensors.torch

    path = str(tmp_path / "llama.safetensors")
    saver = oracle_config(
        ParallelConfig(dp=2, pp=2, tp=2, microbatches=2, schedule="1f1b"), 1, batch_size=BATCH
    )
    worker_pools(8).run(_train_and_export, saver, path, timeout=180)
    serial = _build("llama")
    serial.load_state_dict(safetensors.torch.load_file(path), strict=True)
    ids, targets = TOKENS.at(1)
    with torch.no_grad():
        want = F.cross_entropy(logits_of(serial(ids)).flatten(0, 1), targets.flatten()).item()
    importer = oracle_config(ParallelConfig(dp=2, tp=2), 3, batch_size=BATCH)
    for got in worker_pools(4).run(_import_and_eval, importer, path, timeout=180):
        assert got == pytest.approx(want, rel=1e-5)
