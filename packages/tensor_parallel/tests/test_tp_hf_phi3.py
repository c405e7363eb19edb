"""Optional (extra ``hf``): Hugging Face transformers' Phi3, built from a config (random init,
nothing downloaded), converted by parallelize(PHI3_PLAN) on threaded ranks, equals the serial
model. Phi3 fuses q|k|v into one ``qkv_proj`` (grouped KV heads make its three parts unequal:
(heads, kv_heads, kv_heads) x head_dim) and gate|up into one ``gate_up_proj``, and reads its
query head count from the config it shares with the whole model.

Cases at tp 2: 4 KV heads of 4 (three equal sections), 2 of 4 (parts of 4, 2, 2 heads), each
with and without sequence parallelism, and 1 of 4 (the KV heads copied on both ranks, the
copies' gradients summed; ``test_tp_gqa.py`` checks the fused layer's copies alone). Each case
compares the logits (every rank's vocabulary shard, joined), the loss, every gradient shard
(each copy of a copied KV head included) against ``spec.shard`` of the serial gradient, and
every split parameter and gradient unsharded by its recorded ``ShardSpec`` (as consolidation
joins them) against the serial one.

Tolerances: logits and loss to rtol 1e-5, atol 1e-6, gradients to rtol 1e-4, atol 1e-6: fp32
round-off only (the row-parallel products, the vocab-parallel softmax and the summed KV copies
add in another order; measured, logits differ by <= 7.5e-8 and the loss (~4.2) by <= 4.8e-7,
no gradient by more than 6.3e-7 of its largest element), while a q|k|v part cut across heads,
a head count left whole or a copy not summed is off by the size of the values themselves.
Weights are moved, not computed: unsharded they equal the serial ones exactly.

Runs in ``hatch test`` (the hatch-test environment installs transformers); skipped, with the
reason in the summary, where transformers is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import tessera.tensor_parallel.region_style as region_style_module
from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import (
    PHI3_PLAN,
    FusedHeadShardSpec,
    ShardSpec,
    parallelize,
    resolve_plan,
    shard_specs,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel.layer_styles import Colwise
from tessera.tensor_parallel.probe import probe_attention

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: the HF Phi3 plan is NOT tested "
    "(pip install 'tessera-tensor-parallel[hf]' to test it)",
)

VOCAB, SEQ, HEADS, TP = 64, 8, 4, 2


def _model(kv: int, attn: str = "eager") -> Any:
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=kv, max_position_embeddings=SEQ,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = attn
    return transformers.Phi3ForCausalLM(config)


Result = tuple[
    Tensor, Tensor, dict[str, Tensor], dict[str, Tensor], dict[str, ShardSpec], tuple[int, int, int]
]


def _rank(rank: int, model: Any, sp: bool, batch: tuple[Tensor, Tensor]) -> Result:
    mesh = Mesh(Topology(tp=TP))
    group = mesh.group("tp")
    parallelize(model, plan=PHI3_PLAN, mesh=mesh, sequence_parallel=sp)
    idx, targets = batch
    logits = model(idx, use_cache=False).logits
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), group)
    loss.backward()
    if sp:
        sync_sequence_parallel_grads(model, group)
    named = dict(model.named_parameters())
    attn = model.model.layers[0].self_attn
    counts = (
        attn.config.num_attention_heads,
        attn.config.num_key_value_heads,
        model.config.num_attention_heads,
    )
    grads = {k: p.grad for k, p in named.items() if p.grad is not None}
    weights = {k: p.detach() for k, p in named.items()}
    return logits.detach(), loss.detach(), grads, weights, dict(shard_specs(model)), counts


CASES = [(4, False), (2, False), (4, True), (2, True), (1, False)]  # (kv heads, sequence parallel)


@pytest.mark.parametrize(("kv", "sp"), CASES)
def test_hf_phi3_parallel_equals_serial(kv: int, sp: bool) -> None:
    attn = "sdpa" if kv == 1 else "eager"  # both of HF's attention paths
    torch.manual_seed(0)
    serial = _model(kv, attn)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    logits = serial(idx, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {name: p.grad for name, p in serial.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(serial.parameters()))
    models = [_model(kv, attn) for _ in range(TP)]  # built here: HF draws its init from the global RNG
    for m in models:
        m.load_state_dict(serial.state_dict())
    results: list[Result] = run_threaded(TP, lambda r: _rank(r, models[r], sp, (idx, targets)))

    joined = torch.cat([r[0] for r in results], dim=-1)  # every rank's vocabulary shard
    torch.testing.assert_close(joined, logits.detach(), rtol=1e-5, atol=1e-6)
    specs = results[0][4]
    for rank, (_, parallel_loss, got, _, _, counts) in enumerate(results):
        assert counts == (HEADS // TP, max(1, kv // TP), HEADS)  # the shared config is untouched
        torch.testing.assert_close(parallel_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        assert set(got) == set(grads)
        for name, g in got.items():
            spec = specs.get(name)
            want = grads[name] if spec is None else spec.shard(grads[name], rank, TP)
            try:
                torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the gradient of {name} on rank {rank}")  # keeps torch's report
                raise

    qkv = {k: s for k, s in specs.items() if k.endswith("qkv_proj.weight")}
    assert len(qkv) == 2
    for spec in qkv.values():
        if kv == HEADS:
            assert spec == ShardSpec(0, 3)
        else:
            assert spec == FusedHeadShardSpec(0, parts=(HEADS, kv, kv))
    assert {s for k, s in specs.items() if k.endswith("gate_up_proj.weight")} == {ShardSpec(0, 2)}
    serial_weights = dict(serial.named_parameters())
    for name, spec in specs.items():
        whole = spec.unshard([r[3][name] for r in results])
        assert torch.equal(whole, serial_weights[name].detach()), name
        summed = spec.unshard([r[2][name] for r in results])
        try:
            torch.testing.assert_close(summed, grads[name], rtol=1e-4, atol=1e-6)
        except AssertionError as error:
            error.add_note(f"in the unsharded gradient of {name} ({spec})")
            raise


@pytest.mark.parametrize("kv", [4, 2])
def test_the_plan_splits_qkv_by_heads_and_gate_up_in_two(kv: int) -> None:
    model = _model(kv)
    styles = {a.name: a.style for a in resolve_plan(model, PHI3_PLAN, tp=TP)}  # pure: no process group
    qkv, gate_up = styles["model.layers.1.self_attn.qkv_proj"], styles["model.layers.1.mlp.gate_up_proj"]
    assert isinstance(qkv, Colwise) and isinstance(gate_up, Colwise)
    assert qkv.name == "colwise_qkv" and qkv.parts == (None if kv == HEADS else (HEADS, kv, kv))
    assert gate_up.name == "colwise_gate_up" and gate_up.sections == 2


def test_the_probe_refuses_a_head_count_read_from_the_shared_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi3's forward cuts q|k|v at ``self.config.num_attention_heads * head_dim``: with that
    count left at the whole model's (the config copy not made), rank 0's share fails, and the
    probe names the module before anything changes; made, the shares add up to the module."""
    model = _model(2)
    assignments = resolve_plan(model, PHI3_PLAN, tp=TP)
    probe_attention(model, assignments, tp=TP)
    assert model.model.layers[0].self_attn.config is model.config  # the probe put everything back
    monkeypatch.setattr(region_style_module, "localize_config", lambda module, heads, kv: [])
    with pytest.raises(
        ValueError, match=r"^model\.layers\.0\.self_attn \(attention\): split over tp=2, Phi3Attention"
    ):
        probe_attention(model, assignments, tp=TP)
