"""PhiMoE and ZAYA: sparse MoE blocks whose router is kept as transformers wrote it
(``tessera.launcher.families.hf_moe_kept``, ``tessera.moe.KeptRouter``), their experts converted.

PhiMoE's sparsemixer samples its 2 experts in training (Gumbel, among those within
``router_jitter_noise`` of the best) and trains through its own backward (``PhimoeMultiplier``);
ZAYA's MLP router carries a state from layer to layer and may choose a skip expert (mapped to
expert 0 with weight 0). The models are ``testing_hf_moe.tiny_moe_model``'s (2 layers, hidden 32,
8 experts, top-2; ZAYA's top-1); ``zaya-skip`` raises each router's balancing bias of the skip
expert so that some tokens choose it.

Tier 0: PhiMoE converted trains as transformers' model under the same ``torch.manual_seed``
(loss and every gradient, the default jitter, which does sample here, a wide one, and
Phi-3.5-MoE's input jitter, which the converted layer's experts read too); its eval
logits equal; without jitter the sample is forced (the run does not depend on the seed) and its
custom backward still runs. ZAYA's converted block computes HF's block (output, the state it
carries on, every gradient, the state's too). Both give transformers' logits, load back into
transformers strictly and export transformers' tensors. ``verify=True`` refuses a sampling router
naming ``router_jitter_noise``; ZAYA's layer refuses a gathered input (sequence parallelism); its
pipeline blocks pass ``check_blocks`` and its spec refuses no pp (they carry its router state and
apply its own input scale and bias: ``tests/test_hf_pp_zaya.py`` trains it at pp=2).

Tier 2 (the worker pool), 3 SGD steps (momentum 0.9): PhiMoE with ``router_jitter_noise=0`` in
*training* mode (the sample forced, the custom backward running; sampling makes a run random as
dropout does, so parallel equals serial is held without it) at dp=2 x ep=2 ZeRO-1 (with
``verify=True``, which passes) and ZeRO-3, at tp=2 with no plan (derived roles: experts split
inside over tp), also with Megatron SP, and at pp=2 (1F1B); ZAYA at dp=2 x ep=2 ZeRO-3 and tp=2
(tp=2 with SP refused by its derived plan). A ``save_pretrained`` folder of each imports at dp=2
x ep=2 ZeRO-3 and ``consolidate`` writes it back exactly. At the default jitter,
a wide one and with input jitter under tp=2, each rank's global generator seeded apart, every
call's choices (and jittered tokens) are the same on both tp ranks, and an activation recompute
replays the forward's.

Tolerances: losses and the converted model's gradients against transformers' fp32 rtol 1e-5,
atol 1e-5 (the same products: HF's per-expert loop against one batched matmul; values of order
1); logits rtol and atol 1e-5; parallel runs ``assert_matches_serial``'s bounds (losses rel 1e-5,
SGD weights rtol 1e-5, atol 1e-6). Choices are compared exactly.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.checkpoint.exported import assemble, parts_of
from tessera.launcher.families.hf import decoder_blocks
from tessera.launcher.families.hf_moe import convert_hf_moe, hf_moe_conversion
from tessera.launcher.families.spec import check_blocks, logits_of, model_spec, refusals
from tessera.launcher.testing import RandomTokens, assert_matches_serial, oracle_config, serial_run, sgd
from tessera.launcher.testing_hf_moe import (
    assert_converts_with_the_same_logits,
    assert_export_parts_are_transformers_tensors,
    assert_weights_load_back,
    sparse_blocks,
    tiny_moe_model,
    token_ids,
)
from tessera.launcher.train.verify import Verifier
from tessera.moe import KeptRouter, MoE

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

close = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # losses, gradients, logits (docstring)
SEQ, BATCH, STEPS, LR, VOCAB = 8, 4, 3, 0.2, 64
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


def _build(family: str, jitter: float | None = None, input_jitter: float = 0.0) -> Any:
    """The tiny model of ``family`` (``zaya-skip``: ZAYA with the skip expert's balancing bias
    raised to 0.5); PhiMoE's ``router_jitter_noise`` set to ``jitter`` where given, its
    ``input_jitter_noise`` (the block's and the router's, as its config sets both) to
    ``input_jitter``."""
    model: Any = tiny_moe_model(family.removesuffix("-skip"))
    model.config.use_cache = False
    for block in sparse_blocks(model):
        if jitter is not None:
            block.router.router_jitter_noise = jitter
        if input_jitter:
            block.input_jitter_noise = block.router.input_jitter_noise = input_jitter
        if family == "zaya-skip":
            with torch.no_grad():
                block.gate.balancing_biases[-1] = 0.5
    return model


def _converted(family: str, jitter: float | None = None) -> nn.Module:
    model: nn.Module = _build(family, jitter)
    convert_hf_moe(model)
    return model


def _grads_match(model: nn.Module, converted: nn.Module, exported: Any) -> None:
    """Every converted parameter's gradient against the HF tensors' it is made of."""
    for name, p in converted.named_parameters():
        parts = parts_of(name, exported)
        if not parts:  # outside the mixtures: the same name
            close(p.grad, model.get_parameter(name).grad, msg=lambda m, name=name: f"{name}: {m}")
            continue
        want = assemble(parts, [model.get_parameter(part.name).grad for part in parts])
        close(p.grad, want, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------- tier 0: PhiMoE
@pytest.mark.parametrize(
    ("jitter", "input_jitter"),
    [(None, 0.0), (0.5, 0.0), (None, 0.01)],
    ids=["default-jitter", "jitter-0.5", "input-jitter"],
)
def test_phimoe_trains_as_transformers_under_the_same_seed(jitter: float | None, input_jitter: float) -> None:
    """Training mode, sampling on: the same seed gives transformers' loss and every gradient
    (the router's through PhiMoE's own backward), for two seeds whose samples differ. At the
    default jitter few tokens have a second candidate (the router's gradient may be 0: the
    sparsemixer's gradient flows among the candidates only); at 0.5 many do. With
    Phi-3.5-MoE's ``input_jitter_noise=0.01`` the block and then the router scale the tokens by
    uniform draws, which both router and experts read (the converted layer's experts too)."""
    model = _build("phimoe", jitter, input_jitter)
    converted = copy.deepcopy(model)
    exported = hf_moe_conversion(converted).exported
    assert model.training and converted.training
    ids = token_ids(3, batch=BATCH, seq=SEQ)
    chosen: list[Tensor] = []
    hooks = [
        b.router.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for b in sparse_blocks(model)
    ]
    for seed in (0, 2):  # at the default jitter, seeds whose samples differ here
        model.zero_grad()
        converted.zero_grad()
        torch.manual_seed(seed)
        want = model(ids, labels=ids).loss
        torch.manual_seed(seed)
        got = converted(ids, labels=ids).loss
        close(got, want)
        want.backward()
        got.backward()
        _grads_match(model, converted, exported)
        routers = [p.grad for n, p in converted.named_parameters() if n.endswith("router.module.weight")]
        if jitter is not None:  # many tokens sample among several experts: the router trains
            assert all(g is not None and bool(g.abs().sum() > 0) for g in routers)
    for hook in hooks:
        hook.remove()
    assert any(not torch.equal(a, b) for a, b in zip(chosen[:2], chosen[2:], strict=True))  # it samples


def test_phimoe_eval_logits_and_weights_are_transformers() -> None:
    """Eval mode (deterministic: the best expert, then the next): transformers' logits; weights
    mapped back load strictly into a fresh model; the export parts are transformers' tensors."""
    assert_converts_with_the_same_logits(_build("phimoe").eval())
    assert_weights_load_back(lambda: _build("phimoe").eval())
    assert_export_parts_are_transformers_tensors(_build("phimoe"))


def test_without_jitter_the_sample_is_forced_and_the_custom_backward_runs(monkeypatch: Any) -> None:
    """``router_jitter_noise=0`` in training: the eval choices whatever the seed, and
    ``PhimoeMultiplier``'s backward runs (once per expert slot and layer)."""
    from transformers.models.phimoe import modeling_phimoe

    calls: list[int] = []
    backward = modeling_phimoe.PhimoeMultiplier.backward

    def counted(ctx: Any, grad: Tensor) -> Any:
        calls.append(1)
        return backward(ctx, grad)

    monkeypatch.setattr(modeling_phimoe.PhimoeMultiplier, "backward", staticmethod(counted))
    converted = _converted("phimoe", 0.0)
    ids = token_ids(3, batch=BATCH, seq=SEQ)
    losses = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        loss = converted(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert calls == [1] * 8  # 2 slots x 2 layers x 2 steps
    assert torch.equal(losses[0], losses[1])
    trained = converted(ids).logits
    close(converted.eval()(ids).logits, trained)


def test_verify_refuses_a_sampling_router_naming_its_jitter() -> None:
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.01 .*set them to 0"):
        Verifier(_converted("phimoe"), Config(), loss=None, output=logits_of)
    jittered: nn.Module = _build("phimoe", 0.0, input_jitter=0.01)
    convert_hf_moe(jittered)
    with pytest.raises(ValueError, match=r"input_jitter_noise=0.01 .*set them to 0"):
        Verifier(jittered, Config(), loss=None, output=logits_of)
    Verifier(_converted("phimoe", 0.0), Config(), loss=None, output=logits_of)


# ---------------------------------------------------------------------------- tier 0: ZAYA
def test_a_zaya_block_computes_what_hf_computes() -> None:
    """Layer 1's block (its router reads the state layer 0 carries), with the skip expert chosen
    by some tokens: its output, the state it carries on, and the input's, the given state's and
    every parameter's gradients."""
    model = _build("zaya-skip")
    block = sparse_blocks(model)[1]
    converted = copy.deepcopy(model)
    exported = hf_moe_conversion(converted).exported
    layer = converted.get_submodule("model.layers.1.mlp")
    assert isinstance(layer, MoE) and isinstance(layer.router, KeptRouter)
    gen = torch.Generator().manual_seed(1)
    x, state = torch.randn(3, 5, 32, generator=gen), torch.randn(3, 5, 256, generator=gen)
    g, gs = torch.randn(3, 5, 32, generator=gen), torch.randn(3, 5, 256, generator=gen)
    xa, xb, sa, sb = (t.clone().requires_grad_() for t in (x, x, state, state))
    want, want_state = block(xa, sa)
    got, got_state = layer(xb, sb)
    assert bool((block.gate(x, router_states=state)[1] == 0).any())  # the skip expert is chosen
    close(got, want)
    close(got_state, want_state)
    ((want * g).sum() + (want_state * gs).sum()).backward()
    ((got * g).sum() + (got_state * gs).sum()).backward()
    close(xb.grad, xa.grad)
    close(sb.grad, sa.grad)
    for rel, p in layer.named_parameters():
        parts = parts_of(f"model.layers.1.mlp.{rel}", exported)
        want_grad = assemble(parts, [model.get_parameter(part.name).grad for part in parts])
        close(p.grad, want_grad, msg=lambda m, rel=rel: f"{rel}: {m}")


@pytest.mark.parametrize("family", ["zaya", "zaya-skip"])
def test_zaya_is_transformers_model_both_ways(family: str) -> None:
    assert_converts_with_the_same_logits(_build(family))
    assert_weights_load_back(lambda: _build(family))
    assert_export_parts_are_transformers_tensors(_build(family))


def test_zaya_refuses_a_gathered_input_and_its_pipeline_blocks_reproduce_it() -> None:
    converted = _converted("zaya")
    layer: Any = converted.get_submodule("model.layers.1.mlp")
    layer.gathers = ((1, None),)  # what sequence parallelism sets (split_hidden)
    with pytest.raises(ValueError, match=r"carries a state per token of the whole sequence .*\(1 gathers"):
        layer(torch.randn(2, 4, 32))
    layer.gathers = ()
    check_blocks(converted, decoder_blocks(converted), token_ids(2), logits_of)  # ValueError if not
    assert refusals(converted, model_spec(converted), ["pp"]) == []  # families/known.py: pp taken


# ---------------------------------------------------------------------------- tier 2
Run = tuple[list[float], dict[str, Tensor]]


def _parallel(rank: int, family: str, config: Config, verify: bool = False) -> tuple[Run, list[int]]:
    """One rank's run (PhiMoE without jitter), and over how many tp ranks each mixture splits."""
    model = _converted(family, 0.0 if family == "phimoe" else None)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config, verify=verify)
    try:
        losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
        weights = engine.full_state_dict()
    finally:
        engine.mesh.close()
    return (losses, weights), [m.tp for m in model.modules() if isinstance(m, MoE)]


CASES = {
    "phimoe-ep2-zero1-verify": ("phimoe", ParallelConfig(dp=2, ep=2, microbatches=1), 1, True),
    "phimoe-ep2-zero3": ("phimoe", ParallelConfig(dp=2, ep=2, microbatches=1), 3, False),
    "phimoe-tp2": ("phimoe", ParallelConfig(tp=2, microbatches=1), 1, False),
    "phimoe-tp2-sp": ("phimoe", ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1, False),
    "phimoe-pp2": ("phimoe", ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1, False),
    "zaya-ep2-zero3": ("zaya", ParallelConfig(dp=2, ep=2, microbatches=1), 3, False),
    "zaya-tp2": ("zaya", ParallelConfig(tp=2, microbatches=1), 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_kept_router_model_trains_in_parallel_as_serially(worker_pools: PoolFactory, case: str) -> None:
    family, parallel, zero, verify = CASES[case]
    config = oracle_config(parallel, zero, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, family, config, verify, timeout=240)
    if parallel.tp > 1:
        assert all(splits == [2, 2] for _, splits in results), results[0][1]  # split inside over tp
    serial = serial_run(_converted(family, 0.0 if family == "phimoe" else None), TOKENS.first(STEPS), sgd(LR))
    assert_matches_serial([run for run, _ in results], serial)


def _refusal(rank: int, config: Config) -> str:
    try:
        _parallel(rank, "zaya", config)
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_zaya_under_sequence_parallelism_is_refused(worker_pools: PoolFactory) -> None:
    """tp=2 with Megatron SP: ``boost()`` refuses it on every rank (ZAYA's derived plan keeps its
    attention whole, which SP cannot take), before the mixture's own refusal of a gathered input
    (``test_zaya_refuses_a_gathered_input_and_its_pipeline_blocks_reproduce_it``) is reached."""
    config = oracle_config(ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1, batch_size=BATCH)
    for outcome in worker_pools(config.world_size).run(_refusal, config, timeout=240):
        assert "does not support sequence parallelism" in outcome, outcome


def _tp_choices(rank: int, config: Config, jitter: float | None, input_jitter: float) -> list[Tensor]:
    """Every kept router call's choices on this rank (forwards and recomputes, in order), each with
    the tokens its call hands the experts (jittered where it jitters them), its global generator
    seeded apart from the other rank's first."""
    model: nn.Module = _build("phimoe", jitter, input_jitter)
    convert_hf_moe(model)
    calls: list[Tensor] = []

    def record(mod: Any, _: Any, out: Any) -> None:
        calls.append(out.choices.clone())
        calls.append(out.inputs.detach().clone())

    for m in model.modules():
        if isinstance(m, KeptRouter):
            m.register_forward_hook(record)
    torch.manual_seed(100 + rank)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    try:
        for step in range(2):
            engine.train_step(*TOKENS.at(step))
    finally:
        engine.mesh.close()
    return calls


@pytest.mark.parametrize(
    ("jitter", "input_jitter"),
    [(None, 0.0), (0.5, 0.0), (None, 0.01)],
    ids=["default-jitter", "jitter-0.5", "input-jitter"],
)
def test_tp_ranks_draw_the_same_samples_also_when_recomputed(
    worker_pools: PoolFactory, jitter: float | None, input_jitter: float
) -> None:
    """tp=2 (experts split inside), activation checkpointing on: both tp ranks choose the same
    experts in every call (and, with input jitter, hand the experts the same jittered tokens), and
    each layer's recompute chooses what its forward chose."""
    config = oracle_config(
        ParallelConfig(tp=2, microbatches=1), 1, batch_size=BATCH, activation_checkpointing=True
    )
    first, second = worker_pools(config.world_size).run(
        _tp_choices, config, jitter, input_jitter, timeout=240
    )
    per = 2  # what each call records: its choices, and the tokens it hands the experts (jittered or not)
    assert len(first) == len(second) == 2 * 2 * 2 * per  # 2 steps x 2 layers x (forward, recompute)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    for step in range(2):  # forwards of layers 0, 1, then their recomputes in backward (1, 0)
        calls = first[4 * per * step : 4 * per * (step + 1)]
        calls = [torch.cat([c.float().flatten() for c in calls[i : i + per]]) for i in range(0, 4 * per, per)]
        assert torch.equal(calls[0], calls[3]) and torch.equal(calls[1], calls[2])


def _import(rank: int, config: Config, family: str, folder: str) -> dict[str, Tensor] | None:
    """``folder`` (``save_pretrained``'s) imported into the family's model of other weights,
    boosted under ``config``: what ``consolidate`` then writes (rank 0; None elsewhere)."""
    model: nn.Module = tiny_moe_model(family, seed=5)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    try:
        engine.import_weights(folder)
        return engine.consolidate(Path(folder) / "consolidated.safetensors")
    finally:
        engine.mesh.close()


@pytest.mark.parametrize("family", ["phimoe", "zaya"])
def test_a_save_pretrained_checkpoint_imports_at_dp2_ep2_zero3(
    worker_pools: PoolFactory, tmp_path: Path, family: str
) -> None:
    """Imported under transformers' names (each rank its own experts' tensors, the kept router's
    as they are), ``consolidate`` writes the saved model's state dict exactly (``torch.equal``:
    import and consolidate only copy, slice and transpose)."""
    saved = tiny_moe_model(family, seed=0)
    saved.save_pretrained(tmp_path / family)
    want = {k: v.detach() for k, v in saved.state_dict().items()}
    config = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), 3, batch_size=BATCH)
    got = worker_pools(config.world_size).run(_import, config, family, str(tmp_path / family), timeout=240)[0]
    assert got is not None and sorted(got) == sorted(want), sorted(set(got or {}) ^ set(want))
    wrong = [n for n in want if got[n].shape != want[n].shape or not torch.equal(got[n], want[n])]
    assert not wrong, wrong
