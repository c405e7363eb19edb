"""A model Tessera's own code never assumed, in every mode, with nothing but a plan of roles.

``tessera.models.foreign.Llamaish``: RMSNorm whose weight is ``scale``, rotary positions
from a module inside each attention, a SwiGLU MLP ``w1``/``w2``/``w3``, grouped-query
attention ``wq``/``wk``/``wv``/``wo`` calling ``F.scaled_dot_product_attention`` inline, no
biases. One plan of roles (below) serves 1D with and without Megatron SP, 2D, 2.5D and 3D;
ring and Ulysses find its attention themselves; pipelines find its blocks. Each mode trains
3 steps on the worker pool through ``boost()`` and is held to the same model trained
serially (plain PyTorch). One mode gives it 8 heads at tp=8, which the config's ``[model]``
section (the main job's GPT, 4 heads) could not split: degrees are checked against the
model. ``GPT2ish`` (LayerNorm, biases, a fused q|k|v, learned positions added inline, the
head tied to the token embedding) runs a subset with its own roles, and so does Llamaish
nested as Hugging Face nests its causal LMs (``model.layers``, ``lm_head``).

Bounds: losses rel 1e-5 (a mean of token losses in fp32, summed in another order by the
ranks); weights under SGD with momentum (linear in the gradient) rtol 1e-5, atol 1e-6, at
round-off (measured at most ~1e-7); under AdamW, whose update divides by the root of the
second moment and so amplifies round-off in near-zero gradients, atol 1e-4 on the weights
(measured 2e-5 on one embedding row of a rare token; its steps are lr = 1e-2 wide, and a
wrong gradient moves a weight by about that). A partial
gradient, a wrong shard or a lost contribution is off by the size of an update.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import BoostConfig, Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.testing import (
    Batch,
    RandomTokens,
    Run,
    assert_matches_serial,
    boosted_run,
    oracle_config,
    serial_run,
)
from tessera.models import GPT2ISH_ROLES, LLAMAISH_ROLES, ForeignConfig, GPT2ish, Llamaish

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 3
SIZES = ForeignConfig(vocab=VOCAB, dim=64, heads=4, kv_heads=2, layers=2, hidden=96)
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)

ROLES = LLAMAISH_ROLES  # what each module is; every mode turns it into its own layers


class Trunk(nn.Module):
    """Llamaish's embedding, layers and norm, under ``model`` as Hugging Face's causal LMs
    nest them (``model.layers``): the layer stack is not a child of the model."""

    def __init__(self, base: Llamaish) -> None:
        super().__init__()
        self.tok_embeddings, self.layers, self.norm = base.tok_embeddings, base.layers, base.norm

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.norm(h)
        return out


class Nested(nn.Module):
    """``model`` (the trunk) and ``lm_head``: Llamaish's values in Hugging Face's nesting."""

    def __init__(self, base: Llamaish) -> None:
        super().__init__()
        self.model, self.lm_head = Trunk(base), base.output

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.model(ids))
        return out


NESTED_ROLES = {("lm_head" if k == "output" else f"model.{k}"): v for k, v in ROLES.items()}


FROZEN = ("tok_embeddings", "layers.0.attn", "layers.1.ffn_norm")
"""What a fine-tuning run of Llamaish freezes here: the vocabulary embedding, a whole attention
(column- and row-split projections) and a norm (whose gradient Megatron SP would sum)."""


def _model(kv: int, heads: int, frozen: bool = False) -> nn.Module:
    if kv == 0:  # GPT2ish
        return GPT2ish(SIZES, seed=0)
    if kv < 0:  # Llamaish nested as Hugging Face nests its models
        return Nested(Llamaish(SIZES, seed=0))
    model = Llamaish(dataclasses.replace(SIZES, heads=heads, kv_heads=kv), seed=0)
    for name in FROZEN if frozen else ():
        model.get_submodule(name).requires_grad_(False)
    return model


def _optimizer(model: nn.Module, adamw: bool) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # as a fine-tuning script builds it
    if adamw:  # with frozen parameters, weight decay: one stepped by mistake would shrink
        return torch.optim.AdamW(
            params, lr=1e-2, weight_decay=0.1 if len(params) < len(list(model.parameters())) else 0.0
        )
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batch(step: int, ignored: bool = False) -> Batch:
    inputs, targets = TOKENS.at(step)
    if ignored:  # targets that count for nothing, unevenly over rows, microbatches and positions
        targets[:3, 4:] = -100  # three rows mostly padding
        targets[5] = -100  # a row that counts nothing
        targets[6, : SEQ // 2] = -100  # a masked prompt: the first half of the sequence
    return inputs, targets


def _batches(ignored: bool) -> list[Batch]:
    return [_batch(step, ignored) for step in range(STEPS)]


def _parallel(
    rank: int, kv: int, heads: int, adamw: bool, frozen: bool, config: Config, ignored: bool = False
) -> Run:
    model = _model(kv, heads, frozen)
    plan = {0: GPT2ISH_ROLES, -1: NESTED_ROLES}.get(kv, ROLES)  # context parallelism reads positions from it
    return boosted_run(model, _batches(ignored), config, lambda m: _optimizer(m, adamw), plan=plan)


P = ParallelConfig
MODES: dict[str, tuple[ParallelConfig, dict[str, Any]]] = {
    "tp2": (P(tp=2), {}),
    "tp2-megatron-sp": (P(tp=2, sequence_parallel=True), {}),
    "tp4-kv2-replicated": (P(tp=4), {}),
    "tp4-kv1-megatron-sp": (P(tp=4, sequence_parallel=True), {"kv": 1}),
    "tp8-8heads": (P(tp=8, microbatches=1), {"heads": 8}),  # the config's [model] has 4 heads
    "pp2-1f1b": (P(pp=2, microbatches=2, schedule="1f1b"), {}),
    "pp2-interleaved": (P(pp=2, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2), {}),
    "pp2-zbv": (P(pp=2, microbatches=2, schedule="zbv", virtual_stages=2), {}),
    "dp2-zero3": (P(dp=2), {"stage": 3}),
    "dp2-zero3-disk-adamw": (P(dp=2), {"stage": 3, "adamw": True, "disk": True}),
    "dp2-pp2-zero3": (P(dp=2, pp=2, microbatches=2, schedule="1f1b"), {"stage": 3}),
    "dp2-tp2-zero2": (P(dp=2, tp=2), {"stage": 2}),
    "dp2-pp2-tp2": (P(dp=2, pp=2, tp=2, microbatches=2, schedule="1f1b"), {"stage": 1}),
    "cp2-ring-zigzag": (P(cp=2, cp_layout="zigzag"), {}),
    "cp2-ulysses": (P(cp=2, cp_mode="ulysses"), {}),
    "2d": (P(tp=4, tp_mode="2d"), {}),
    "2.5d": (P(tp=8, tp_mode="2.5d", tp_depth=2, microbatches=1), {}),
    "3d": (P(tp=8, tp_mode="3d", microbatches=1), {}),
    "gpt2ish-tp2-megatron-sp": (P(tp=2, sequence_parallel=True), {"kv": 0}),
    "gpt2ish-dp2-tp2-zero3": (P(dp=2, tp=2), {"kv": 0, "stage": 3}),
    "gpt2ish-sp2-ring-zigzag": (P(cp=2, cp_layout="zigzag"), {"kv": 0}),
    "gpt2ish-2d": (P(tp=4, tp_mode="2d"), {"kv": 0}),
    "gpt2ish-3d": (P(tp=8, tp_mode="3d", microbatches=1), {"kv": 0}),
    "nested-dp2-zero3": (P(dp=2), {"kv": -1, "stage": 3}),
    "nested-dp2-zero3-disk-adamw": (P(dp=2), {"kv": -1, "stage": 3, "adamw": True, "disk": True}),
    "nested-pp2-1f1b": (P(pp=2, microbatches=2, schedule="1f1b"), {"kv": -1}),
    "nested-dp2-tp2-zero3-megatron-sp": (P(dp=2, tp=2, sequence_parallel=True), {"kv": -1, "stage": 3}),
    "nested-sp2-ring-zigzag": (P(cp=2, cp_layout="zigzag"), {"kv": -1}),
    "nested-2d": (P(tp=4, tp_mode="2d"), {"kv": -1}),
    "frozen-dp2-zero3-adamw": (P(dp=2), {"stage": 3, "adamw": True, "frozen": True}),
    "frozen-dp2-tp2-zero1-megatron-sp": (P(dp=2, tp=2, sequence_parallel=True), {"stage": 1, "frozen": True}),
    "frozen-pp2-zbv": (P(pp=2, microbatches=2, schedule="zbv", virtual_stages=2), {"frozen": True}),
    "frozen-sp2-ring-zigzag": (P(cp=2, cp_layout="zigzag"), {"frozen": True}),
    "frozen-2d": (P(tp=4, tp_mode="2d"), {"frozen": True}),
    "frozen-3d": (P(tp=8, tp_mode="3d", microbatches=1), {"frozen": True}),
    # targets of -100 (padding, masked prompts) count for nothing: the mean is per counted token
    "ignored-dp2-microbatches2": (P(dp=2, microbatches=2), {"stage": 1, "ignored": True}),
    "ignored-dp2-tp2-megatron-sp-zero3": (
        P(dp=2, tp=2, sequence_parallel=True),
        {"stage": 3, "ignored": True},
    ),
    "ignored-sp2-ring-contiguous": (P(cp=2, microbatches=2), {"ignored": True}),
    "ignored-dp2-sp2-ulysses-zigzag": (
        P(dp=2, cp=2, cp_mode="ulysses", cp_layout="zigzag"),
        {"ignored": True},
    ),
    "ignored-pp2-interleaved": (
        P(pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
        {"ignored": True},
    ),
    "ignored-dp2-2d": (P(dp=2, tp=4, tp_mode="2d", microbatches=1), {"ignored": True}),
    "ignored-2.5d": (P(tp=8, tp_mode="2.5d", tp_depth=2, microbatches=2), {"ignored": True}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_foreign_model_follows_its_serial_run_in_every_mode(
    worker_pools: PoolFactory, tmp_path: Path, mode: str
) -> None:
    parallel, extra = MODES[mode]
    kv, heads, adamw = int(extra.get("kv", 2)), int(extra.get("heads", 4)), bool(extra.get("adamw", False))
    frozen, ignored = bool(extra.get("frozen", False)), bool(extra.get("ignored", False))
    zero = ZeroConfig(stage=int(extra.get("stage", 0)))
    if extra.get("disk"):
        zero = dataclasses.replace(zero, disk_dir=str(tmp_path), host_budget_mb=0.5, chunk_numel=2048)
    config = oracle_config(parallel, zero, batch_size=BATCH)
    assert BoostConfig.validate(config) == []  # the core: the degrees are checked against the model given
    if heads == 8:  # ... not against [model], the main job's GPT, which tp=8 would not split
        assert any("model.n_heads=4 does not split 8 ways" in e for e in config.validate())
    results = worker_pools(config.world_size).run(
        _parallel, kv, heads, adamw, frozen, config, ignored, timeout=240
    )
    if extra.get("disk"):
        assert any(p.is_file() for p in tmp_path.rglob("*")), "no chunk reached the disk"
    serial = serial_run(_model(kv, heads, frozen), _batches(ignored), lambda m: _optimizer(m, adamw))
    rtol, atol = (1e-4, 1e-4) if adamw else (1e-5, 1e-6)  # the bounds of the module docstring
    merged = assert_matches_serial(results, serial, rtol=rtol, atol=atol)
    start = dict(_model(kv, heads, frozen).named_parameters())
    for name in [n for n, p in start.items() if not p.requires_grad]:  # exported as they were
        torch.testing.assert_close(merged[name], start[name].detach(), rtol=0, atol=0)


def _frozen_run(rank: int, path: str, config: Config, save: bool, shift: float) -> Run:
    """Llamaish with ``FROZEN`` frozen (``shift`` added to them: a model built otherwise): the
    first run trains 2 steps, saves and trains 2 more; the others load and train those 2."""
    model = _model(2, 4, frozen=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.0 if p.requires_grad else shift)
    engine = boost(model, _optimizer(model, adamw=False), config, plan=ROLES)
    if save:
        for step in range(2):
            engine.train_step(*_batch(step))
        engine.save(path)
    else:
        engine.load(path)
    losses = [engine.train_step(*_batch(step)).loss for step in range(2, 4)]
    weights = engine.full_state_dict()
    engine.close()
    return losses, weights


def test_frozen_parameters_are_saved_and_reshard_into_other_layouts(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """A checkpoint of a fine-tuning run (tp2 with Megatron SP, ZeRO-1, its first step verified
    against a serial one) resumes under dp2 ZeRO-3 and a pipeline, from models whose frozen
    parameters were built with other values: they come from the checkpoint, exactly, and the
    run goes on as it would have (SGD: weights to round-off, bounds in the module docstring)."""
    P = ParallelConfig

    def config(parallel: ParallelConfig, stage: int, verify: bool = False) -> Config:
        base = Config(
            parallel=parallel,
            zero=ZeroConfig(stage=stage),
            train=TrainConfig(precision="fp32", verify=verify),
        )
        return dataclasses.replace(base, data=dataclasses.replace(base.data, batch_size=BATCH))

    path = str(tmp_path / "ckpt")
    pool = worker_pools(2)

    def merged(runs: list[Run]) -> Run:
        return runs[-1][0], {k: v for _, part in runs for k, v in part.items()}

    losses, weights = merged(
        pool.run(_frozen_run, path, config(P(tp=2, sequence_parallel=True), 1, verify=True), True, 0.0)
    )
    start = dict(_model(2, 4, frozen=True).named_parameters())
    frozen = [n for n, p in start.items() if not p.requires_grad]
    assert len(frozen) == 6, frozen  # tok_embeddings, wq/wk/wv/wo of layers.0, layers.1.ffn_norm
    for parallel, stage in ((P(dp=2), 3), (P(pp=2, microbatches=2), 0)):
        again, resumed = merged(pool.run(_frozen_run, path, config(parallel, stage), False, 1.0))
        assert again == pytest.approx(losses, rel=1e-5), parallel
        torch.testing.assert_close(
            resumed, weights, rtol=1e-5, atol=1e-6, msg=lambda m, p=parallel: f"{p}: {m}"
        )
        for name in frozen:
            torch.testing.assert_close(resumed[name], start[name].detach(), rtol=0, atol=0)
