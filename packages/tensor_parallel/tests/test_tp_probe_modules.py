"""Every module a style splits proves itself before converting (``probe_modules``), and a
scaled embedding (Hugging Face Gemma's) keeps its scale in every vocabulary-split embedding.

Tier 0 (pure, no process group): the probe runs each tp rank's share of the first module of
each (class, style) pair locally and requires the shares to reassemble the module's own output.
It accepts the built-in plans (the reference GPT, HF GPT-2 with its tied head, HF Llama, at tp
2 and 4, and the 2D/2.5D/3D translations of the GPT plans), and refuses, naming the module, its
class, the style and what differs: an embedding multiplying by 3 under an attribute the
parallel embeddings do not know (``gain``), a colwise ``nn.Linear`` subclass adding a constant
or scaling its output, and Gemma's scaled embedding when the parallel embedding would not carry
its scale (the code before the fix, by a monkeypatched ``VocabParallelEmbedding.scale_of``). Rows
a user's spec copies on every rank beside split ones (a fused q|k|v with one KV head) count once.

Tier 1 (threaded ranks): ``parallelize`` refuses the scaled user embedding on every rank with
the model unchanged; the 2D and 3D embeddings of a scaled embedding equal it exactly (a lookup:
bit for bit); Gemma under ``LLAMA_PLAN`` at tp 2, with and without sequence parallelism, gives
the serial logits and gradients after one forward and backward. Tolerance there: fp32
round-off only (the row-parallel products and the vocab-parallel softmax sum in another order;
measured <= 6e-8 on logits up to 0.74 and gradients up to 0.24): logits rtol 1e-5, atol 1e-6,
gradients rtol 1e-4, atol 1e-6. With the scale dropped (and the probe off) the embedding's
output is off by a factor sqrt(32) = 5.66 and the logits by 0.15 (measured).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Mesh, Topology, TPMode
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import (
    GPT2_PLAN,
    GPT_PLAN,
    LLAMA_PLAN,
    BaseStyle,
    Cube3D,
    Embedding2D,
    Embedding3D,
    Grid2D,
    Role,
    VocabEmbedding2D,
    VocabEmbedding3D,
    VocabParallelEmbedding,
    parallelize,
    resolve_plan,
    shard_of,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel.modes import plan_for_mode
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.plan import PlanLike
from tessera.tensor_parallel.probe_modules import ModuleProbe, probe_modules

VOCAB, SEQ = 64, 8


def _probe(model: nn.Module, plan: PlanLike, tp: int) -> ModuleProbe:
    return probe_modules(model, resolve_plan(model, plan, tp=tp), tp=tp)


def _gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2))


def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF NOT probed")
    ids = {"bos_token_id": VOCAB - 1, "eos_token_id": VOCAB - 1}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, **ids
        )
        return transformers.GPT2LMHeadModel(config)  # type: ignore[no-any-return]
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, pad_token_id=None,
            **ids,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)  # type: ignore[no-any-return]
    config = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, intermediate_size=64, max_position_embeddings=SEQ, **ids,
    )  # fmt: skip
    return transformers.GemmaForCausalLM(config)  # type: ignore[no-any-return]


MODELS: dict[str, tuple[Callable[[], nn.Module], PlanLike, set[str]]] = {
    "gpt": (_gpt, GPT_PLAN, {"embed.tok", "layers.0.attn.q_proj", "layers.0.attn.out_proj", "head.lm_head"}),
    "hf-gpt2-tied": (
        lambda: _hf("gpt2"),
        GPT2_PLAN,
        {"transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "lm_head"},
    ),
    "hf-llama": (
        lambda: _hf("llama"),
        LLAMA_PLAN,
        {
            "model.embed_tokens",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.o_proj",
            "lm_head",
        },
    ),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_built_in_plans_pass_the_probe(name: str, tp: int) -> None:
    build, plan, expected = MODELS[name]
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = _probe(model, plan, tp)
    assert expected <= set(report.probed)
    assert report.largest < 1e-6  # fp32 round-off of the row-parallel sums
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("mode", "tp", "depth"), [("2d", 4, None), ("2.5d", 8, 2), ("3d", 8, None)])
@pytest.mark.parametrize("name", ["gpt", "hf-gpt2-tied"])
def test_the_2d_2p5d_3d_styles_pass_the_probe(name: str, mode: str, tp: int, depth: int | None) -> None:
    build, plan, _ = MODELS[name]
    model = build()
    report = _probe(model, plan_for_mode(plan, mode, model, depth=depth), tp)
    assert len(report.probed) >= 6 and report.largest < 1e-6  # embeddings, norm, dense, head: split in blocks


class Gained(nn.Embedding):
    """An embedding scaled by a factor the parallel embeddings know nothing of."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, dim)
        self.gain = 3.0

    def forward(self, idx: Tensor) -> Tensor:
        return super().forward(idx) * self.gain


class Offset(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + 0.5


class Doubled(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return 2.0 * super().forward(x)


class Net(nn.Module):
    def __init__(self, tok: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.tok, self.proj = tok, proj


PLAN = {"tok": "vocab", "proj": "colwise_gather"}


def _net(tok: type[nn.Embedding] = nn.Embedding, proj: type[nn.Linear] = nn.Linear) -> Net:
    torch.manual_seed(0)
    return Net(tok(VOCAB, 16), proj(16, 32))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_an_embedding_scaled_under_another_name_is_refused(tp: int) -> None:
    refusal = (
        rf"tok \(vocab\): Gained \(from .*\) split over tp={tp} does not compute what the module "
        r"computes: its output is scaled by 3 \("
    )
    with pytest.raises(ValueError, match=refusal):
        _probe(_net(tok=Gained), PLAN, tp)


@pytest.mark.parametrize(("layer", "what"), [(Offset, "shifted by 0.5"), (Doubled, "scaled by 2")])
def test_a_colwise_linear_whose_forward_does_more_is_refused(layer: type[nn.Linear], what: str) -> None:
    with pytest.raises(
        ValueError, match=rf"proj \(colwise_gather\): {layer.__name__} .*: its output is {what}"
    ):
        _probe(_net(proj=layer), PLAN, 2)


def test_plain_modules_and_an_embed_scale_pass() -> None:
    class Scaled(nn.Embedding):  # what the parallel embeddings carry: an embed_scale attribute
        embed_scale: Tensor

        def __init__(self, vocab: int, dim: int) -> None:
            super().__init__(vocab, dim)
            self.register_buffer("embed_scale", torch.tensor(3.0), persistent=False)

        def forward(self, idx: Tensor) -> Tensor:
            return super().forward(idx) * self.embed_scale.to(self.weight.dtype)

    for net in (_net(), _net(tok=Scaled)):
        report = _probe(net, PLAN, 2)
        assert report.probed == ("tok", "proj") and report.largest < 1e-6


@dataclass(frozen=True, slots=True)
class CopiedRows(ShardSpec):
    """Rows [0, 8) split over tp, rows [8, 12) copied on every rank (a fused q|k|v whose one KV
    head is fewer than tp: each rank holds ``[q_r | k | v]``)."""

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        per = 8 // tp
        return torch.cat([full[rank * per : (rank + 1) * per], full[8:12]])


@dataclass(frozen=True, slots=True)
class CopiesStyle(BaseStyle):
    """A user's style: the layer above, its output features split as ``CopiedRows`` says."""

    role: Role = Role.ENTER

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return CopiedRows(0)


@pytest.mark.parametrize("tp", [2, 4])
def test_rows_copied_beside_split_ones_count_once(tp: int) -> None:
    net = Net(nn.Embedding(VOCAB, 16), nn.Linear(16, 12))
    report = _probe(net, {"proj": CopiesStyle("copies")}, tp)
    assert report.probed == ("proj",) and report.largest < 1e-6


def test_without_the_fix_the_probe_refuses_gemma(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _hf("gemma")
    assert _probe(model, LLAMA_PLAN, 2).largest < 1e-6
    monkeypatch.setattr(VocabParallelEmbedding, "scale_of", staticmethod(lambda module: None))  # as before
    refusal = (
        r"model.embed_tokens \(vocab_whole\): GemmaTextScaledWordEmbedding \(from transformers\..*\) split "
        r"over tp=2 does not compute what the module computes: its output is scaled by 5.657 \("
    )
    with pytest.raises(ValueError, match=refusal):
        _probe(model, LLAMA_PLAN, 2)


def _refused_and_unchanged(rank: int, net: Net) -> tuple[str, bool]:
    mine = copy.deepcopy(net)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    with pytest.raises(ValueError, match="scaled by 3") as info:
        parallelize(mine, plan=PLAN, mesh=Mesh(Topology(tp=2)))
    same = all(torch.equal(before[k], v) for k, v in mine.state_dict().items())
    return str(info.value), same and type(mine.tok) is Gained


def test_parallelize_refuses_on_every_rank_before_anything_changes() -> None:
    results = run_threaded(2, _refused_and_unchanged, _net(tok=Gained))
    assert [same for _, same in results] == [True, True]
    assert results[0][0] == results[1][0]


class ScaledEmbedding(nn.Embedding):
    """Gemma's: its lookups times a non-persistent embed_scale buffer, in the weight's dtype."""

    embed_scale: Tensor

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, dim)
        self.register_buffer("embed_scale", torch.tensor(dim**0.5), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        return super().forward(idx) * self.embed_scale.to(self.weight.dtype)


def _nd_lookups(rank: int, mode: TPMode, serial: ScaledEmbedding, idx: Tensor) -> list[tuple[Tensor, Tensor]]:
    mesh = Mesh(Topology(tp=8 if mode is TPMode.THREE_D else 4, tp_mode=mode))
    out = []
    if mode is TPMode.TWO_D:
        grid = Grid2D.from_mesh(mesh)
        rows, block = idx.chunk(2, 0)[grid.i], serial(idx).chunk(2, 0)[grid.i].chunk(2, -1)[grid.j]
        layers: list[nn.Module] = [
            VocabEmbedding2D.from_dense(serial, grid),
            Embedding2D.from_dense(serial, grid),
        ]
    else:
        cube = Cube3D.from_mesh(mesh)
        rows = idx.chunk(4, 0)[cube.b * 2 + cube.a]
        block = serial(idx).chunk(4, 0)[cube.b * 2 + cube.a].chunk(2, -1)[cube.c]
        layers = [VocabEmbedding3D.from_dense(serial, cube), Embedding3D.from_dense(serial, cube)]
    with torch.no_grad():
        for layer in layers:
            out.append((layer(rows), block))
    return out


@pytest.mark.parametrize("mode", [TPMode.TWO_D, TPMode.THREE_D])
def test_the_2d_and_3d_embeddings_keep_the_scale_bit_for_bit(mode: TPMode) -> None:
    torch.manual_seed(0)
    serial = ScaledEmbedding(VOCAB, 16)
    idx = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    n = 8 if mode is TPMode.THREE_D else 4
    for pairs in run_threaded(n, _nd_lookups, mode, serial, idx):
        for got, want in pairs:
            assert torch.equal(got, want)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_gemma_at_tp2_equals_serial(sequence_parallel: bool) -> None:
    tp = 2
    torch.manual_seed(0)
    serial = _hf("gemma")
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    logits = serial(idx, use_cache=False).logits
    torch.autograd.backward(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    grads = {n: p.grad for n, p in serial.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(serial.parameters()))
    models = [_hf("gemma") for _ in range(tp)]  # built here: HF draws its init from the global RNG
    for m in models:
        m.load_state_dict(serial.state_dict())

    def rank(r: int) -> tuple[Tensor, dict[str, tuple[Any, Tensor]]]:
        mesh = Mesh(Topology(tp=tp))
        model = parallelize(models[r], plan=LLAMA_PLAN, mesh=mesh, sequence_parallel=sequence_parallel)
        out = model(idx, use_cache=False).logits
        torch.autograd.backward(
            vocab_parallel_cross_entropy(out.flatten(0, 1), targets.flatten(), mesh.group("tp"))
        )
        sync_sequence_parallel_grads(model, mesh.group("tp"))
        pairs = {n: (p.grad, shard_of(model, n, grads[n])) for n, p in model.named_parameters()}
        return out.detach(), pairs

    for r, (out, pairs) in enumerate(run_threaded(tp, rank)):
        torch.testing.assert_close(out, logits.detach().chunk(tp, -1)[r], rtol=1e-5, atol=1e-6)
        assert set(pairs) == set(grads)
        for name, (got, want) in pairs.items():
            try:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the gradient of {name} on rank {r}")
                raise
