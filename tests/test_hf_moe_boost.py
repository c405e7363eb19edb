"""Hugging Face MoE models through ``boost()`` without converting them by hand: ``boost()``
converts their sparse MoE blocks itself (``hf_moe.hf_moe_conversion``) and keeps
transformers' names in exports, ``consolidate`` and ``import_weights`` (built from tiny configs,
nothing downloaded).

Tier 0: for Mixtral (its block saved as ``block_sparse_moe``), Qwen2-MoE (a gated shared
expert), DeepSeek-V3 (a score-correction bias, a dense layer), Llama 4 (gate and up in the
columns of ``gate_up_proj``) and GPT-OSS (those columns alternating; biases): the conversion's
export parts, streamed through ``Joiner``, give transformers' state dict exactly (names, shapes,
values; a fresh model loads it strictly), and its persistent buffer under HF's name; the way
back (``assemble``) gives every converted tensor exactly from the state dict's fused tensors and
from the per-expert tensors ``save_pretrained`` writes (the parts' ``legacy`` names, read from
the pinned transformers' conversion mapping: ``hf_names``), also for some experts only (what an
ep rank reads), and so does import's reader of a safetensors file (each part's band, and some
experts', read by ``LazyTensors.read_part``). Bounds: ``torch.equal``: every step is a
copy, slice or transpose, no arithmetic.

Tier 2 (the worker pool): an unconverted ``MixtralForCausalLM`` boosted at dp=2 x ep=2 imports
a folder written by ``save_pretrained`` (per-expert tensors; each ep rank reads its experts'
only) or a state dict's safetensors file (fused ``gate_up_proj``; each rank reads its experts'
gate or up rows; ZeRO-3), and at tp=2 the folder; a DeepSeek-V3 at dp=2 x ep=2 the folder (its
score-correction bias, a buffer, under HF's name); a Llama 4 the folder (gate and up by columns)
and a GPT-OSS the state dict's file (gate and up alternating in the columns, expert and router
biases; ZeRO-3), both at dp=2 x ep=2. Each holds exactly the weights transformers'
own ``from_pretrained`` reads, converted (``torch.equal``); its first loss is transformers'
model's (rel 1e-5: fp32, the same products summed in another order); trained 3 SGD steps it
equals the serial run of the converted model (losses rel 1e-5), and its consolidated file loads
strictly into a fresh model of the family, and with ``from_pretrained`` beside its config, both
with the serially trained model's logits (rtol and atol 1e-5, logits of order 1). Blocks that
cannot convert are refused at ep=2 naming the class and left as written at ep=1.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import ParallelConfig, boost
from tessera.launcher.checkpoint.exported import (
    Joiner,
    assemble,
    export_shapes,
    found_parts,
    parts_of,
    sliced,
)
from tessera.launcher.checkpoint.placement import persistent_buffers
from tessera.launcher.checkpoint.reshard import _AsParams
from tessera.launcher.checkpoint.tensorfile import LazyTensors
from tessera.launcher.families.hf_moe import convert_hf_moe, hf_moe_conversion, is_hf_sparse_moe
from tessera.launcher.families.hf_names import expert_merges, hf_renames
from tessera.launcher.testing import RandomTokens, oracle_config, redrawn, serial_run, sgd
from tessera.moe import MoE

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
BASE = {
    "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 32,
}  # fmt: skip
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {
        "intermediate_size": 20, "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "mlp_only_layers": [1],
    }),
    "deepseek_v3": ("DeepseekV3Config", {
        "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
        "num_key_value_heads": 4, "intermediate_size": 20, "moe_intermediate_size": 12,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 8,
    }),
    "llama4_text": ("Llama4TextConfig", {  # gate and up in the columns of gate_up_proj [E, d, 2h]
        "intermediate_size": 12, "intermediate_size_mlp": 20, "num_local_experts": 4, "head_dim": 4,
    }),
    "gpt_oss": ("GptOssConfig", {  # the same, alternating, with biases
        "intermediate_size": 12, "num_local_experts": 4, "head_dim": 4,
    }),
}  # fmt: skip
MODELS = {"Llama4TextConfig": "Llama4ForCausalLM"}  # else the config's name, ForCausalLM
BANKS = tuple(f"experts.{w}" for w in ("w1", "w3", "w2", "b1", "b3", "b2"))  # the experts' tensors
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


def _build(family: str = "mixtral", seed: int = 0, **changes: Any) -> nn.Module:
    """The family's tiny model, every parameter and score-correction bias drawn anew from
    ``seed`` (HF's own init leaves the biases at zero)."""
    cls, sizes = CONFIGS[family]
    model = getattr(transformers, MODELS.get(cls, cls.replace("Config", "ForCausalLM")))(
        getattr(transformers, cls)(**{**BASE, **sizes, **changes})
    )
    return redrawn(model, seed)


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_export_parts_are_transformers_tensors_both_ways(family: str, tmp_path: Path) -> None:
    model = _build(family)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    renames = hf_renames(model)  # read as transformers loads them: Mixtral's block_sparse_moe is mlp
    saved = {
        (renames(k) if renames else k): v
        for k, v in safetensors.torch.load_file(tmp_path / "model.safetensors").items()
    }
    merges = expert_merges(model)
    converted = copy.deepcopy(model)
    conversion = hf_moe_conversion(converted, {n: 0 for n, _ in model.named_parameters()})
    assert conversion.blocks and not any(is_hf_sparse_moe(m) for m in converted.modules())
    params = {n: p.detach() for n, p in converted.named_parameters()}
    assert set(conversion.groups) == {n for n in params if n.startswith(tuple(conversion.blocks))}
    # out: streamed as consolidate streams them, laid out beforehand
    shapes = export_shapes({n: tuple(p.shape) for n, p in params.items()}, conversion.exported)
    joiner, out = Joiner(conversion.exported, list(params)), {}
    for name, value in params.items():
        for part in parts_of(name, conversion.exported):
            tensor = joiner.add(part, part.take(value))
            if tensor is not None:
                out[part.name] = tensor
    want = {n for n, _ in model.named_parameters()}
    assert list(out) == list(shapes) and set(out) == want, sorted(set(out) ^ want)
    wrong = [n for n in out if tuple(out[n].shape) != shapes[n] or not torch.equal(out[n], hf[n])]
    assert not wrong, wrong
    buffers = {parts_of(n, conversion.exported)[0].name: b for n, b in persistent_buffers(converted).items()}
    for name, buffer in buffers.items():  # a score-correction bias
        assert torch.equal(buffer, hf[name]), name
    _build(family, seed=3).load_state_dict({**out, **buffers}, strict=True)  # transformers' names
    # back: from the state dict's fused tensors and from save_pretrained's per-expert ones
    for source, layout in ((hf, "fused"), (saved, "per-expert")):
        for name, value in params.items():
            parts = found_parts(parts_of(name, conversion.exported), source.__contains__)
            assert parts is not None, f"{layout}: {name}"
            assert torch.equal(assemble(parts, [source[p.name] for p in parts]), value), f"{layout}: {name}"
            if name.endswith(BANKS):  # an ep rank's experts
                per_expert = layout == "per-expert" and bool(merges)  # else fused
                assert ("experts.0." in parts[0].name) == per_expert, parts[0].name
                mine, by_rows = sliced(parts, 1, 3)
                values = [source[p.name][1:3] if by_rows else source[p.name] for p in mine]
                assert torch.equal(assemble(mine, values), value[1:3]), f"{layout}: {name}"
    # from a file, as import_weights reads it: each part's band (and an ep rank's experts) only
    safetensors.torch.save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "state.safetensors")
    with LazyTensors([tmp_path / "state.safetensors"]) as weights:
        sources = {n: parts_of(n, conversion.exported) for n in params}
        read = _AsParams(weights, sources, {})
        for name, value in params.items():
            assert torch.equal(read[f"param/{name}"], value.float()), name
            if name.endswith(BANKS):
                assert torch.equal(read.rows(f"param/{name}", 1, 3), value[1:3].float()), name


def test_the_per_expert_tensors_are_read_from_transformers_conversion_mapping() -> None:
    """Each family's checkpoint layout (what ``save_pretrained`` writes and transformers merges
    on load) as `expert_merges` reads it from the pinned transformers, and the block renames
    (Mixtral's ``block_sparse_moe`` for ``mlp``) as `hf_renames` reads them."""
    want = {
        "mixtral": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
        "qwen2_moe": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        "deepseek_v3": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        "llama4_text": {},  # saved as the model holds them
        "gpt_oss": {},
    }
    assert {family: expert_merges(_build(family)) for family in CONFIGS} == want
    renames = hf_renames(_build("mixtral"))
    assert renames is not None
    assert (
        renames("model.layers.1.block_sparse_moe.experts.3.w1.weight")
        == "model.layers.1.mlp.experts.3.w1.weight"
    )
    assert renames("model.layers.1.block_sparse_moe.gate.weight") == "model.layers.1.mlp.gate.weight"
    assert renames("model.layers.1.mlp.experts.gate_up_proj") == "model.layers.1.mlp.experts.gate_up_proj"


def test_what_cannot_convert_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="output_router_logits=True"):
        hf_moe_conversion(_build(output_router_logits=True))
    phimoe = transformers.PhimoeForCausalLM(  # its router is kept (hf_moe_kept), top-1 refused
        transformers.PhimoeConfig(**BASE, intermediate_size=12, num_local_experts=4, num_experts_per_tok=1)
    )
    with pytest.raises(ValueError, match=r"PhimoeSparseMoeBlock: top_k=1: the sparsemixer chooses 2 experts"):
        hf_moe_conversion(phimoe)
    assert sum(is_hf_sparse_moe(m) for m in phimoe.modules()) == 2  # nothing swapped


# ---------------------------------------------------------------------------- tier 2
def _import_and_train(
    rank: int, config: Any, family: str, source: str, out: str
) -> tuple[dict[str, Tensor], float, list[float]]:
    model = _build(family, seed=1)  # weights of its own, all replaced by the import
    engine = boost(model, sgd(LR)(model), config)
    try:
        engine.import_weights(source)
        imported = engine.full_state_dict()
        first = engine.eval_loss(*TOKENS.at(0))
        losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
        engine.consolidate(out)
    finally:
        engine.close()
    return imported, first, losses


@pytest.mark.parametrize(
    ("family", "layout", "parallel", "zero"),
    [
        ("mixtral", "save_pretrained", ParallelConfig(dp=2, ep=2, microbatches=1), 1),
        ("mixtral", "state_dict", ParallelConfig(dp=2, ep=2, microbatches=1), 3),
        ("mixtral", "save_pretrained", ParallelConfig(tp=2, microbatches=1), 1),  # the mixture whole
        ("deepseek_v3", "save_pretrained", ParallelConfig(dp=2, ep=2, microbatches=1), 1),  # its bias
        ("llama4_text", "save_pretrained", ParallelConfig(dp=2, ep=2, microbatches=1), 1),  # by columns
        ("gpt_oss", "state_dict", ParallelConfig(dp=2, ep=2, microbatches=1), 3),  # strided, biases
    ],
    ids=["mixtral-save_pretrained-dp2-ep2", "mixtral-state_dict-dp2-ep2-zero3", "mixtral-save_pretrained-tp2",
         "deepseek_v3-save_pretrained-dp2-ep2", "llama4_text-save_pretrained-dp2-ep2",
         "gpt_oss-state_dict-dp2-ep2-zero3"],
)  # fmt: skip
def test_an_hf_checkpoint_imports_trains_and_consolidates_under_hf_names(
    worker_pools: PoolFactory, tmp_path: Path, family: str, layout: str, parallel: ParallelConfig, zero: int
) -> None:
    pretrained = _build(family, seed=7)
    pretrained.save_pretrained(tmp_path / "hf")
    source = tmp_path / "hf"
    if layout == "state_dict":  # fused gate_up_proj, as the model names it
        source = tmp_path / "state.safetensors"
        safetensors.torch.save_file({k: v.contiguous() for k, v in pretrained.state_dict().items()}, source)
    cls = type(pretrained)
    loaded = cls.from_pretrained(tmp_path / "hf")  # transformers' own read
    config = oracle_config(parallel, zero, batch_size=BATCH)
    out = tmp_path / "consolidated" / "model.safetensors"
    out.parent.mkdir()
    results = worker_pools(config.world_size).run(
        _import_and_train, config, family, str(source), str(out), timeout=180
    )
    serial = copy.deepcopy(loaded)
    convert_hf_moe(serial)
    before = {n: p.detach().clone() for n, p in serial.named_parameters()}
    ids, targets = TOKENS.at(0)
    with torch.no_grad():
        hf_loss = float(F.cross_entropy(loaded(ids).logits.flatten(0, 1), targets.flatten()))
    losses, _ = serial_run(serial, TOKENS.first(STEPS), sgd(LR))  # trains ``serial`` in place
    for imported, first, curve in results:
        assert imported.keys() == before.keys()
        differ = [n for n in imported if not torch.equal(imported[n], before[n])]
        assert not differ, differ
        assert first == pytest.approx(hf_loss, rel=1e-5)
        assert curve == pytest.approx(losses, rel=1e-5)
    ids = TOKENS.at(99)[0]
    fresh = _build(family, seed=3)
    fresh.load_state_dict(safetensors.torch.load_file(out), strict=True)  # transformers' names
    torch.testing.assert_close(fresh(ids).logits, serial(ids).logits, rtol=1e-5, atol=1e-5)
    pretrained.config.save_pretrained(out.parent)
    reread = cls.from_pretrained(out.parent)
    torch.testing.assert_close(reread(ids).logits, serial(ids).logits, rtol=1e-5, atol=1e-5)


def _boost_outcome(rank: int, config: Any, changes: dict[str, Any], phimoe: bool) -> str:
    if phimoe:
        model: nn.Module = transformers.PhimoeForCausalLM(  # one expert per token: refused (hf_moe_kept)
            transformers.PhimoeConfig(
                **BASE,
                intermediate_size=12,
                num_local_experts=4,
                num_experts_per_tok=1,
            )
        )
    else:
        model = _build(**changes)
    try:
        engine = boost(model, sgd(LR)(model), config)
    except ValueError as exc:
        return f"refused: {exc}"
    kinds = sorted(
        {type(m).__name__ for m in engine.module.modules() if is_hf_sparse_moe(m) or isinstance(m, MoE)}
    )
    engine.close()
    return f"boosted: {kinds}"


def _import_refusal(rank: int, config: Any, source: str) -> str:
    model = _build()
    engine = boost(model, sgd(LR)(model), config)
    try:
        engine.import_weights(source)
    except ValueError as exc:
        return str(exc)
    finally:
        engine.close()
    return "imported"


def test_a_checkpoint_that_does_not_fit_is_refused_naming_its_tensors(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    _build(intermediate_size=20).save_pretrained(tmp_path / "narrow")  # experts 20 wide, not 24
    state = {k: v for k, v in _build().state_dict().items() if "experts.down_proj" not in k}
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in state.items()}, tmp_path / "partial.safetensors"
    )
    config = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), 1, batch_size=BATCH)
    pool = worker_pools(config.world_size)
    narrow = pool.run(_import_refusal, config, str(tmp_path / "narrow"))[0]
    assert "tensors do not fit the model" in narrow, narrow
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight [20, 16]" in narrow, narrow
    partial = pool.run(_import_refusal, config, str(tmp_path / "partial.safetensors"))[0]
    assert "lacks 2 parameters of the model" in partial, partial
    assert "model.layers.0.mlp.experts.down_proj (or model.layers.0.mlp.experts.0.w2" in partial


def test_blocks_that_cannot_convert_are_refused_at_ep2_and_left_at_ep1(worker_pools: PoolFactory) -> None:
    ep2 = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), 1, batch_size=BATCH)
    ep1 = dataclasses.replace(ep2, parallel=ParallelConfig(dp=2, microbatches=1))
    pool = worker_pools(ep2.world_size)
    logits = {"output_router_logits": True}
    assert pool.run(_boost_outcome, ep2, logits, False)[0].startswith(
        "refused: config.output_router_logits=True"
    )
    assert pool.run(_boost_outcome, ep1, logits, False)[0] == "boosted: ['MixtralSparseMoeBlock']"
    assert pool.run(_boost_outcome, ep1, {}, False)[0] == "boosted: ['MoE']"
    refused = pool.run(_boost_outcome, ep2, {}, True)[0]
    assert "PhimoeSparseMoeBlock: top_k=1: the sparsemixer chooses 2 experts" in refused, refused
