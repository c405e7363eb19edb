"""Integration: context parallelism through boost() for a model that names nothing.

``Llamaish`` (written outside Tessera: GQA with 2 of 4 KV heads, a rotary module inside each
attention, ``F.scaled_dot_product_attention`` inline) goes through ``boost()`` with a
``ModelSpec`` that names no attention cores and no positions: its SDPA calls are routed to
ring attention and its rotary modules (found by class) follow the zigzag shards. At cp2 x
tp2 (cp=2 alone is one of ``test_every_mode``'s modes; a 1D plan of roles; each tp rank
routes its 2 query heads and 1 KV head) it
trains 3 SGD steps (momentum); so does Hugging Face Llama (its built-in spec, which names
none either) at cp=2 under Ulysses and at pp2 x cp2 (its pipeline blocks call the rotary
module with local positions, which follow the shards as in its own forward). Each run is
compared with the same model trained serially (plain PyTorch: forward, mean cross-entropy,
backward, SGD). Bounds as ``test_user_models``: losses
rel 1e-5 (fp32, a mean over 128 token losses summed in another order), consolidated weights
atol 1e-6 + rtol 1e-5 (SGD is linear in the gradient: round-off; rotary left on local
positions moves the loss by ~3e-4 and gradients by > 1e-3, as measured in the tensor_parallel
package's ``test_cp_route_gloo``).

Each of those runs passes context parallelism's sequence-split probe first (no false alarm).
``InlineRope``, Llama-style but computing its rotary angles inline from ``torch.arange`` of the
length its attention is handed, would train silently wrong at cp=2; boost() refuses it on every
rank before training, at cp=2 and at dp2 x cp2 with ZeRO-3, naming its attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ModelSpec, ParallelConfig, boost
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    assert_matches_serial,
    boosted_run,
    oracle_config,
    serial_run,
    sgd,
)
from tessera.models.foreign import ForeignConfig, Llamaish
from tessera.tensor_parallel import Plan, Style

CFG = ForeignConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, hidden=48, max_len=16)
SEQ, BATCH, STEPS, LR = 16, 8, 3, 0.5
TOKENS = RandomTokens(vocab=CFG.vocab, batch=BATCH, seq=SEQ)

LLAMAISH_PLAN = Plan.of(
    {
        "tok_embeddings": Style.VOCAB,
        "layers.*.attn": Style.ATTENTION,
        "layers.*.attn.wq": Style.COLWISE,
        "layers.*.attn.wk": Style.COLWISE,
        "layers.*.attn.wv": Style.COLWISE,
        "layers.*.attn.wo": Style.ROWWISE,
        "layers.*.ffn": Style.REGION,
        "layers.*.ffn.w1": Style.COLWISE,
        "layers.*.ffn.w3": Style.COLWISE,
        "layers.*.ffn.w2": Style.ROWWISE,
        "output": Style.COLWISE,
    },
    name="llamaish",
)


def _hf_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=CFG.vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=CFG.vocab - 1,
        eos_token_id=CFG.vocab - 1, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)  # type: ignore[no-any-return]


def _build(name: str) -> nn.Module:
    return Llamaish(CFG, seed=0) if name == "llamaish" else _hf_llama()


def _parallel(rank: int, name: str, config: Config) -> Run:
    # no attention_cores, no positions; HF Llama: its built-in spec (which names none either)
    spec = ModelSpec(plans={"1d": LLAMAISH_PLAN}) if name == "llamaish" else None
    return boosted_run(_build(name), TOKENS.first(STEPS), config, sgd(LR), spec=spec)


@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        ("llamaish", ParallelConfig(tp=2, cp=2, cp_layout="zigzag", microbatches=1)),
        ("hf-llama", ParallelConfig(cp=2, cp_mode="ulysses", microbatches=1)),
        ("hf-llama", ParallelConfig(pp=2, cp=2, microbatches=2, schedule="1f1b")),
    ],
    ids=[
        "llamaish-sp2-tp2-ring-zigzag",
        "hf-llama-sp2-ulysses",
        "hf-llama-pp2-sp2-ring",
    ],
)
def test_routed_attention_follows_the_serial_run(
    worker_pools: PoolFactory, name: str, parallel: ParallelConfig
) -> None:
    if name.startswith("hf"):
        pytest.importorskip("transformers", reason="transformers is not installed: HF Llama NOT tested")
    config = oracle_config(parallel, batch_size=BATCH)
    assert config.validate() == []
    results = worker_pools(config.world_size).run(_parallel, name, config, timeout=180)
    assert_matches_serial(results, serial_run(_build(name), TOKENS.first(STEPS), sgd(LR)))


class InlineRopeAttention(nn.Module):
    """Llama-style attention whose rotary angles come from ``torch.arange`` of its input's length."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        angles = torch.outer(torch.arange(t, dtype=torch.float32), inv)  # positions 0..t-1 of what it sees
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

        def rotate(z: Tensor) -> Tensor:
            half = z.shape[-1] // 2
            return z * cos + torch.cat((-z[..., half:], z[..., :half]), dim=-1) * sin

        shape = (b, t, self.heads, self.head_dim)
        q, k, v = (w(x).view(shape).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        out: Tensor = self.wo(y.transpose(1, 2).reshape(b, t, d))
        return out


class InlineRopeLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), InlineRopeAttention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        out: Tensor = x + self.ffn(self.ffn_norm(x))
        return out


class InlineRope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(CFG.vocab, CFG.dim)
        self.layers = nn.ModuleList(InlineRopeLayer(CFG.dim, CFG.heads) for _ in range(CFG.layers))
        self.norm, self.output = nn.RMSNorm(CFG.dim), nn.Linear(CFG.dim, CFG.vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.output(self.norm(h))
        return out


def _refused(rank: int, config: Config) -> str:
    """boost()'s ValueError on this rank ("trained" if it trained a step); the groups of the
    mesh boost built before refusing are destroyed, so the pool's next call starts clean."""
    before = set(dist.distributed_c10d._world.pg_map)
    model = InlineRope()
    try:
        engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    except ValueError as e:
        for group in set(dist.distributed_c10d._world.pg_map) - before:
            dist.destroy_process_group(group)
        return str(e)
    engine.train_step(*TOKENS.at(0))
    engine.close()
    return "trained"


@pytest.mark.parametrize(
    ("parallel", "stage"),
    [(ParallelConfig(cp=2, microbatches=1), 0), (ParallelConfig(dp=2, cp=2, microbatches=1), 3)],
    ids=["cp2-ring", "dp2-sp2-ring-zero3"],
)
def test_positions_from_the_local_length_are_refused_before_training(
    worker_pools: PoolFactory, parallel: ParallelConfig, stage: int
) -> None:
    config = oracle_config(parallel, stage, batch_size=BATCH)
    for message in worker_pools(config.world_size).run(_refused, config, timeout=180):
        assert "the first module whose output differs is 'layers.0.attn' (InlineRopeAttention)" in message
        assert "derives positions or a mask from the local sequence length" in message
        assert "ModelSpec(positions=...)" in message
