"""``boost(..., verify=True)``: the first step of a parallel model is compared with a serial step
of the same model, and a mismatch refuses to train, naming the parameters.

The model is ``tessera.models.foreign.Llamaish`` (a user's Llama-style model: GQA, rotary,
SwiGLU, RMSNorm) with a hand-written 1D plan. A deliberately broken style (a column-parallel
layer whose weight gradient loses half of its sum, as a skipped reduction would) trains
without a word when verify is off and is refused, naming the parameter, when it is on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ModelSpec, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.spec import logits_of
from tessera.launcher.train.engine import Engine
from tessera.launcher.train.verify import Verifier, compare_gradients, tolerance
from tessera.models import GPT, GPTConfig
from tessera.models.foreign import ForeignConfig, Llamaish
from tessera.tensor_parallel import Plan, Style
from tessera.tensor_parallel.layer_styles import Colwise
from tessera.tensor_parallel.style import ApplyContext, register_style

SEQ, BATCH = 16, 8
BROKEN = "colwise_half_grad"


@dataclass(frozen=True, slots=True)
class HalfGradColwise(Colwise):
    """Column-parallel, but the weight's gradient is halved: a lost half of a reduction."""

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        out = Colwise.apply(self, module, ctx)
        target = out if out is not None else module
        target.get_parameter("weight").register_hook(lambda g: g * 0.5)  # type: ignore[no-untyped-call]
        return out


def _plan(w1: str = "colwise") -> Plan:
    return Plan.of(
        {
            "tok_embeddings": Style.VOCAB,
            "layers.*.attn": Style.ATTENTION,
            "layers.*.attn.wq": Style.COLWISE,
            "layers.*.attn.wk": Style.COLWISE,
            "layers.*.attn.wv": Style.COLWISE,
            "layers.*.attn.wo": Style.ROWWISE,
            "layers.*.ffn": Style.REGION,
            "layers.*.ffn.w1": w1,
            "layers.*.ffn.w3": Style.COLWISE,
            "layers.*.ffn.w2": Style.ROWWISE,
            "output": Style.COLWISE,
        },
        name="llamaish" if w1 == "colwise" else "llamaish-broken",
    )


def _batch(step: int, ignored: bool = False) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, ForeignConfig().vocab, (BATCH, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if ignored:  # targets that count for nothing, more of them in some rows than in others
        targets[0, 2:] = -100
        targets[1, : SEQ // 2] = -100
    return inputs, targets


def _config(parallel: ParallelConfig, zero: int, precision: str = "fp32") -> Config:
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision=precision))
    return dataclasses.replace(c, data=dataclasses.replace(c.data, batch_size=BATCH))


def _train(
    rank: int,
    config: Config,
    w1: str,
    verify: bool | None,
    tied: bool = False,
    lose_tied_sum: bool = False,
    ignored: bool = False,
) -> dict[str, Any]:
    """Two steps; what verify said (the error text, or None), its log and the weights after.
    ``tied``: the LM head shares the token embedding's weight (two pipeline ranks hold it);
    ``lose_tied_sum``: the engine forgets to sum that weight's gradient over its holders."""
    register_style(HalfGradColwise(BROKEN), replace=True)
    model = Llamaish(ForeignConfig(), seed=0)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    spec = ModelSpec(plans={"1d": _plan(w1)})
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config, spec=spec, verify=verify,
                   example=_batch(0)[0][:2])  # fmt: skip
    error = None
    losses = []
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tessera.launcher.train.verify")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    lost = mock.patch.object(Engine, "_sum_tied_gradients", lambda self: None)
    try:
        with lost if lose_tied_sum else contextlib.nullcontext():
            losses = [engine.train_step(*_batch(step, ignored)).loss for step in range(2)]
    except ValueError as e:
        error = str(e)
    finally:
        logger.removeHandler(handler)
    out: dict[str, Any] = {"error": error, "losses": losses, "log": lines, "step": engine.step}
    out["verifier"] = engine.verifier is not None
    out["weights"] = engine.full_state_dict()
    engine.mesh.close()
    return out


PASSING = {
    "tp2": (ParallelConfig(tp=2), 0, "fp32", False),
    "tp2-zero2-bf16": (ParallelConfig(tp=2), 2, "bf16", False),
    "dp2-pp2-zero1": (ParallelConfig(dp=2, pp=2, microbatches=2, schedule="1f1b"), 1, "fp32", False),
    "dp2-tp2-sp-zero3": (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 3, "fp32", False),
    "pp2-tied-fp16": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1, "fp16", True),
}


@pytest.mark.parametrize(("parallel", "zero", "precision", "tied"), PASSING.values(), ids=list(PASSING))
def test_verify_passes_a_correct_plan(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int, precision: str, tied: bool
) -> None:
    config = _config(parallel, zero, precision)
    assert config.optim.clip_grad_norm > 0  # verified before clipping
    pool = worker_pools(config.world_size)
    for result in pool.run(_train, config, "colwise", True, tied, timeout=180):
        assert result["error"] is None
        assert not result["verifier"] and result["step"] == 2 and len(result["losses"]) == 2
        *skipped, line = result["log"]  # the first step that updates, with its tolerance and cost
        assert all("skipped" in s for s in skipped) and len(skipped) <= 1  # fp16 may overflow first
        assert f"{precision}, rtol {tolerance(precision):.2g}" in line and " s" in line.split("cost")[1]
        print(line)


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(dp=2, microbatches=2), ParallelConfig(pp=2, microbatches=2, schedule="1f1b")],
    ids=["dp2-microbatches2", "pp2"],
)
def test_verify_holds_the_mean_per_counted_token(worker_pools: PoolFactory, parallel: ParallelConfig) -> None:
    """Targets of -100 fall unevenly on the ranks' rows and microbatches: the serial step is the
    mean over the batch's counted tokens, and the parallel step equals it (a mean per
    microbatch, averaged, weighs the sparse rows too much and is refused)."""
    config = _config(parallel, 1)
    pool = worker_pools(config.world_size)
    for result in pool.run(_train, config, "colwise", True, False, False, True, timeout=180):
        assert result["error"] is None, result["error"]
        assert not result["verifier"] and result["step"] == 2


def _train_gpt(rank: int, parallel: ParallelConfig) -> list[str]:
    """One verified step of the reference GPT (its registered spec: 2D plan, attention cores)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tessera.launcher.train.verify")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    model = GPT(GPTConfig(vocab_size=64, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2), seed=0)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(parallel, 1), verify=True)
    try:
        engine.train_step(*_batch(0))
    finally:
        logger.removeHandler(handler)
        engine.mesh.close()
    return lines


GPT_MODES = {
    "2d-tp4": ParallelConfig(tp=4, tp_mode="2d"),
    "ring-zigzag-sp2": ParallelConfig(cp=2, cp_mode="ring", cp_layout="zigzag"),
    "ulysses-sp2": ParallelConfig(cp=2, cp_mode="ulysses"),
}


@pytest.mark.parametrize("parallel", GPT_MODES.values(), ids=list(GPT_MODES))
def test_verify_passes_the_reference_gpt_in_other_modes(
    worker_pools: PoolFactory, parallel: ParallelConfig
) -> None:
    for lines in worker_pools(parallel.tp * parallel.cp).run(_train_gpt, parallel, timeout=180):
        assert len(lines) == 1 and "equals the serial one" in lines[0]


def test_verify_refuses_a_lost_reduction_and_names_the_parameter(worker_pools: PoolFactory) -> None:
    config = _config(ParallelConfig(tp=2), 0)
    initial = dict(Llamaish(ForeignConfig(), seed=0).named_parameters())
    silent = worker_pools(2).run(_train, config, BROKEN, False, timeout=180)
    assert all(r["error"] is None for r in silent)  # without verify, it trains without a word
    refused = worker_pools(2).run(_train, dataclasses.replace(config, train=dataclasses.replace(
        config.train, verify=True)), BROKEN, None, timeout=180)  # fmt: skip
    for result in refused:
        error = result["error"]
        assert error is not None and "verify" in error and result["step"] == 0
        assert "layers.0.ffn.w1.weight" in error and "layers.1.ffn.w1.weight" in error
        assert "rel 0.5" in error  # half the gradient is missing
        assert "w3" not in error and "loss" in error.lower()
        for name, value in result["weights"].items():  # nothing was updated
            torch.testing.assert_close(value, initial[name].detach(), rtol=0, atol=0)


def test_verify_refuses_a_tied_weight_whose_copies_were_not_summed(worker_pools: PoolFactory) -> None:
    config = _config(ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1)
    for result in worker_pools(2).run(_train, config, "colwise", True, True, True, timeout=180):
        error = result["error"]
        assert error is not None and result["step"] == 0
        assert "1 of" in error and "tok_embeddings.weight" in error  # each holder misses the other's part


# ---------------------------------------------------------------------------- no ranks
def test_tolerance_follows_the_dtype() -> None:
    assert tolerance("fp32") == 1e-4
    assert tolerance("bf16") == 8 * 2**-7 and tolerance("fp16") == 8 * 2**-10
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        tolerance("fp8")


def test_compare_gradients_names_the_worst_first() -> None:
    serial = {"a": torch.ones(3), "b": torch.full((2,), 2.0), "c": torch.zeros(2)}
    parallel = {"a": torch.ones(3), "b": torch.tensor([2.0, 1.0]), "c": torch.tensor([0.0, 1e-9])}
    differ, worst = compare_gradients(serial, parallel, 1e-4)
    assert [d.name for d in differ] == ["b"] and differ[0].rel == 0.5 and differ[0].abs == 1.0
    assert worst is not None and worst.name == "b"  # "c" is tiny against the model's scale
    differ, _ = compare_gradients(serial, {"a": torch.ones(4)}, 1e-4)
    assert "shape (4,), serial (3,)" in differ[0].name


def test_dropout_is_refused_with_a_line() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"verify: .*1 has dropout \(p=0.1\).*dropout 0"):
        Verifier(model, Config(), loss=None, output=logits_of)
    Verifier(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)), Config(), loss=None, output=logits_of)


def test_the_flag_and_the_field_reach_boost(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from tessera.launcher.config.config_io import config_to_toml, resolve_config
    from tessera.launcher.run import cli

    assert Config().train.verify is False
    assert resolve_config(None, ["train.verify=true"], env={}).train.verify is True
    assert resolve_config(None, [], env={"TESSERA_TRAIN_VERIFY": "1"}).train.verify is True
    toml = tmp_path / "job.toml"
    toml.write_text(config_to_toml(resolve_config(None, ["train.verify=true"], env={})))
    assert "verify = true" in toml.read_text()
    assert resolve_config(str(toml), [], env={}).train.verify is True
    seen: list[Config] = []

    def launch(args: Any, target: list[str], config: Config, **kw: Any) -> int:
        seen.append(config)  # what would be spawned
        return 0

    monkeypatch.setattr(cli, "_run", launch)
    script = tmp_path / "job.py"
    script.write_text("")
    assert cli.main(["run", "--verify", str(script)]) == 0
    assert cli.main(["train", "--verify"]) == 0
    assert cli.main(["run", str(script)]) == 0
    assert [c.train.verify for c in seen] == [True, True, False]


def test_what_verify_cannot_compare_is_refused_before_spawning() -> None:
    from tessera.launcher.config.verify_rules import verify_problems
    from tessera.launcher.run.preflight import preflight

    config = dataclasses.replace(Config(), train=TrainConfig(verify=True))
    assert verify_problems(config, main_job=True) == []
    chunked = dataclasses.replace(config, zero=ZeroConfig(stage=3, host_budget_mb=64))
    dropout = dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.1))
    assert any("chunk memory manager" in e for e in preflight(chunked, main_job=False))
    assert any("model.dropout=0.1" in e for e in verify_problems(dropout, main_job=True))
    assert verify_problems(dropout, main_job=False) == []  # a script's model is checked by boost
    with pytest.raises(ValueError, match=r"verify: cannot compare .* chunk memory manager"):
        Verifier(nn.Linear(2, 2), chunked, loss=None, output=logits_of)
