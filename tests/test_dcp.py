"""``torch.distributed.checkpoint`` (DCP) both ways, against FSDP2 in the same test.

In one pool call on 2 gloo ranks: FSDP2 (``fully_shard`` per block and at the root, on the CPU
world group) trains the reference GPT (and a Hugging Face Llama whose head is tied to its
embedding) 2 SGD steps and saves its sharded (DTensor) model state with DCP, once as
``{"model": state}`` (FSDP2's tutorials) and once bare (torchtitan); Tessera boosted as dp2
ZeRO-3, tp2 and pp2, from other initial weights, imports it (``Engine.import_dcp``), trains one
step and exports DCP (``Engine.export_dcp``), which a fresh FSDP2 model loads (``dcp.load`` into
``get_model_state_dict``, then ``set_model_state_dict``). Both ways are compared bitwise
(``torch.equal``): nothing is computed on the way, fp32 values are only copied, sliced and
joined. A wrong shard, name or prefix is off by whole values. A DeepSeek-V3, whose experts
boost() trains under names of its own and whose router holds a persistent bias, goes in and
straight out again at dp2 ZeRO-3 and pp2 (the bias on one pipeline rank only).

The refusal: a model that is not the saved one raises one ValueError on every rank, naming the
names and shapes, and its weights are unchanged. The metadata of a DCP folder is a pickle: one
that names anything but DCP's metadata classes is refused without running it.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import ParallelConfig, boost
from tessera.launcher.checkpoint.dcp import find_prefix
from tessera.launcher.checkpoint.dcp_files import METADATA, DCPReader
from tessera.launcher.testing import RandomTokens, logits_of, oracle_config, sgd
from tessera.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, bias=False)
TOKENS = RandomTokens(vocab=32, batch=8, seq=8)
LAYOUTS = {  # name: (parallel, ZeRO stage, the prefix Tessera exports under)
    "dp2-zero3": (ParallelConfig(dp=2), 3, "model"),
    "tp2": (ParallelConfig(tp=2), 0, ""),
    "pp2": (ParallelConfig(pp=2, microbatches=2), 0, "model"),
}
MODELS = {  # the layouts each model is imported into (a tied head: its second name in the checkpoint)
    "gpt": ["dp2-zero3", "tp2", "pp2"],
    "llama-tied": ["pp2"],  # the embedding and the tied head on two pipeline ranks
}


def build(name: str, seed: int) -> nn.Module:
    """The reference GPT, a tiny Hugging Face Llama with its head tied to the embedding, or
    `deepseek_v3`."""
    if name == "gpt":
        return GPT(CFG, seed=seed)
    if name == "deepseek-v3":
        return deepseek_v3(seed)
    torch.manual_seed(seed)
    sizes = {
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
        "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))


def deepseek_v3(seed: int) -> nn.Module:
    """A tiny DeepSeek-V3 (its second layer a mixture of experts whose router has a persistent
    score-correction bias; boost() trains the experts under names of its own), every parameter
    and the bias drawn from ``seed`` (HF leaves routers and the bias at zero)."""
    config = transformers.DeepseekV3Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, intermediate_size=20, moe_intermediate_size=12,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=8,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for _, b in sorted(model.named_buffers()):
            if b.dtype.is_floating_point and b.ndim == 1 and b.numel() == 8:  # the router's bias
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model  # type: ignore[no-any-return]


def _fsdp(model: nn.Module) -> nn.Module:
    """``model`` sharded by FSDP2 over the world group (2 gloo ranks, CPU), block by block."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    blocks = model.layers if isinstance(model, GPT) else model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> dict[str, Tensor]:
    """FSDP2's full (unsharded) state dict, on every rank."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _fsdp_load(name: str, path: Path, prefix: str) -> dict[str, Tensor]:
    """A fresh FSDP2 model loads the DCP folder ``path`` as its users do; its full weights."""
    model = _fsdp(build(name, seed=3))
    state = get_model_state_dict(model)
    target: dict[str, Any] = {prefix: state} if prefix else state
    dcp.load(target, checkpoint_id=str(path))
    set_model_state_dict(model, target[prefix] if prefix else target)
    return _full(model)


def _both_ways(rank: int, model_name: str, out: str) -> dict[str, Any]:
    root = Path(out)
    model = _fsdp(build(model_name, seed=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for ids, targets in TOKENS.first(2):  # each rank its half of the rows
        optimizer.zero_grad()
        logits = logits_of(model(ids[rank * 4 : rank * 4 + 4]))
        F.cross_entropy(logits.flatten(0, 1), targets[rank * 4 : rank * 4 + 4].flatten()).backward()
        optimizer.step()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(root / "fsdp"))
    dcp.save(get_model_state_dict(model), checkpoint_id=str(root / "fsdp-bare"))
    result: dict[str, Any] = {"fsdp": _full(model)}
    for name in MODELS[model_name]:
        parallel, zero, prefix = LAYOUTS[name]
        tessera = build(model_name, seed=2)
        engine = boost(tessera, sgd(0.5)(tessera), oracle_config(parallel, zero, batch_size=8))
        try:
            engine.import_dcp(root / ("fsdp-bare" if name == "tp2" else "fsdp"))
            imported = engine.full_state_dict()
            engine.train_step(*TOKENS.at(5))
            trained = engine.full_state_dict()
            engine.export_dcp(root / name, prefix=prefix)
        finally:
            engine.close()
        result[name] = (imported, trained, _fsdp_load(model_name, root / name, prefix))
    return result


def _moe_round_trip(rank: int, out: str) -> dict[str, Any]:
    root = Path(out)
    model = _fsdp(build("deepseek-v3", seed=1))
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(root / "fsdp"))
    ids, targets = TOKENS.at(7)
    with torch.no_grad():
        loss = float(F.cross_entropy(logits_of(model(ids)).flatten(0, 1), targets.flatten()))
    result: dict[str, Any] = {"fsdp": _full(model), "loss": loss}
    for name in ("dp2-zero3", "pp2"):  # pp2: the bias on the second pipeline rank only
        parallel, zero, prefix = LAYOUTS[name]
        tessera = build("deepseek-v3", seed=2)
        engine = boost(tessera, sgd(0.5)(tessera), oracle_config(parallel, zero, batch_size=8))
        try:
            engine.import_dcp(root / "fsdp")
            evaluated = engine.eval_loss(ids, targets)
            engine.export_dcp(root / name, prefix=prefix)
        finally:
            engine.close()
        result[name] = (evaluated, _fsdp_load("deepseek-v3", root / name, prefix))
    return result


def test_a_converted_mixture_of_experts_with_a_router_bias_goes_in_and_out(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """The user's names of converted experts and a persistent buffer: imported, the engine's
    loss equals FSDP2's on the same batch (rel 1e-5: fp32, the same products summed in another
    order); exported again, FSDP2 loads every tensor bit for bit."""
    for rank in worker_pools(2).run(_moe_round_trip, str(tmp_path)):
        fsdp = rank["fsdp"]
        assert any(k.endswith("e_score_correction_bias") for k in fsdp)
        for name in ("dp2-zero3", "pp2"):
            evaluated, loaded = rank[name]
            assert evaluated == pytest.approx(rank["loss"], rel=1e-5), name
            differ = [k for k in fsdp if not torch.equal(loaded[k], fsdp[k])]
            assert sorted(loaded) == sorted(fsdp) and not differ, f"{name}: {differ}"


@pytest.mark.parametrize("model_name", list(MODELS))
def test_dcp_from_fsdp2_into_every_layout_and_back(
    worker_pools: PoolFactory, tmp_path: Path, model_name: str
) -> None:
    ranks = worker_pools(2).run(_both_ways, model_name, str(tmp_path))
    fsdp = ranks[0]["fsdp"]
    assert all(torch.equal(ranks[1]["fsdp"][k], v) for k, v in fsdp.items())
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if model_name == "llama-tied" else {}
    assert all(torch.equal(fsdp[alias], fsdp[tied]) for alias, tied in aliases.items())
    params = {k: v for k, v in fsdp.items() if k not in aliases}  # FSDP2's state dict holds both names
    start = build(model_name, seed=2).state_dict()
    assert not any(torch.equal(start[k], v) for k, v in params.items()), "the import must change every weight"
    for name in MODELS[model_name]:
        imported = {k: v for rank in ranks for k, v in rank[name][0].items()}  # pp: each its stages'
        trained = {k: v for rank in ranks for k, v in rank[name][1].items()}
        assert sorted(imported) == sorted(params), name
        differ = [k for k in params if not torch.equal(imported[k], params[k])]
        assert not differ, f"{name}: imported weights differ from FSDP2's in {differ}"
        assert any(not torch.equal(trained[k], params[k]) for k in params), f"{name}: the step moved nothing"
        want = trained | {alias: trained[tied] for alias, tied in aliases.items()}
        for rank, got in enumerate(r[name][2] for r in ranks):
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert sorted(got) == sorted(want) and not differ, f"{name}, FSDP2 rank {rank}: {differ}"
    assert {p.name for p in tmp_path.iterdir()} == {"fsdp", "fsdp-bare", *MODELS[model_name]}  # no staging


# ---------------------------------------------------------------- refusals
def _refused(rank: int, ok: str, torn: str, flipped: str) -> list[tuple[str, bool]]:
    """Each refused import's message, and whether the weights are as they were."""
    fewer, more = dataclasses.replace(CFG, vocab_size=40, n_layers=1), dataclasses.replace(CFG, n_layers=3)
    dp2, tp2 = ParallelConfig(dp=2), ParallelConfig(tp=2)
    out = []
    cases = [(fewer, dp2, 3, ok), (more, dp2, 3, ok), (CFG, tp2, 0, torn), (CFG, tp2, 0, flipped)]
    for cfg, parallel, zero, path in cases:
        model = GPT(cfg, seed=4)
        engine = boost(model, sgd(0.5)(model), oracle_config(parallel, zero, batch_size=8))
        try:
            before = engine.full_state_dict()
            with pytest.raises(ValueError) as caught:
                engine.import_dcp(path)
            after = engine.full_state_dict()
        finally:
            engine.close()
        out.append((str(caught.value), all(torch.equal(before[k], after[k]) for k in before)))
    return out


def test_another_model_is_refused_on_every_rank_naming_names_and_shapes(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves in one process
        dcp.save({"model": GPT(CFG).state_dict()}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
        for bad in ("torn", "flipped"):
            dcp.save({"model": GPT(CFG).state_dict()}, checkpoint_id=str(tmp_path / bad), no_dist=True)
    torn, flipped = tmp_path / "torn" / "__0_0.distcp", tmp_path / "flipped" / "__0_0.distcp"
    torn.write_bytes(torn.read_bytes()[:1000])  # cut short: refused before anything is read
    data = bytearray(flipped.read_bytes())
    data[:64] = bytes(64)  # the same length, the first record's zip header zeroed: found as it is read
    flipped.write_bytes(bytes(data))
    paths = [str(tmp_path / name) for name in ("ok", "torn", "flipped")]
    for rank in worker_pools(2).run(_refused, *paths):
        (fewer, unchanged_1), (more, unchanged_2), (cut, unchanged_3), (read, _) = rank
        assert unchanged_1 and unchanged_2 and unchanged_3, "a refused import changed the weights"
        assert cut.startswith(f"{torn} is cut short: 1000 bytes, .metadata places data up to ")
        assert "\n" not in read and f"from {tmp_path / 'flipped'}: " in read, read  # (read after the checks)
        assert "\n" not in fewer + more
        assert fewer.startswith(f"{tmp_path / 'ok'} does not hold this model's weights (under 'model'): ")
        assert "shapes differ (2): embed.tok.weight saved [32, 16], the model's [40, 16]" in fewer
        assert "not in the model (10): layers.1.attn.k_proj.weight" in fewer
        assert "missing (10): layers.2.attn.k_proj.weight" in more


def test_prefixes_are_found_where_the_names_are() -> None:
    names = {"model.embed.weight", "lm_head.weight"}  # a Hugging Face model's own names start with model.
    assert find_prefix(["model.embed.weight", "lm_head.weight", "optimizer.state.x"], names) == ""
    assert find_prefix(["model.model.embed.weight", "model.lm_head.weight"], names) == "model"
    optimizer = "app.optim.state.lm_head.weight.momentum_buffer"  # DCP's flattened optimizer state
    assert find_prefix(["app.model.lm_head.weight", optimizer], names) == "app.model"
    assert find_prefix(["optimizer.step"], names) == ""
    with pytest.raises(ValueError, match=r"under 2 prefixes \['a', 'b'\]"):
        find_prefix(["a.lm_head.weight", "b.lm_head.weight"], names)


class _Runs:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (print, ("this must not run",))


def test_metadata_naming_anything_else_is_refused_unrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / METADATA).write_bytes(pickle.dumps(_Runs()))
    with pytest.raises(ValueError, match=r"builtins.print is not part of a DCP checkpoint's metadata"):
        DCPReader(tmp_path)
    assert "must not run" not in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"has no \.metadata"):
        DCPReader(tmp_path / "absent")
