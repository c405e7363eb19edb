"""Tiers 0 and 1: the main job's ``[moe]`` section (its refusals name the values), the model it
builds (`moe_gpt`), and the expert load it logs (`ExpertLoad`), counted on ranks as threads
and checked against the layers' own statistics; the planner adapter's view of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.comm.testing import run_threaded
from tessera.launcher.config import Config, MoEConfig, ParallelConfig
from tessera.launcher.config.auto import config_of, experts_of, job_of, layout_of, model_of
from tessera.launcher.config.config_io import resolve_config
from tessera.launcher.job.main_job import build_model
from tessera.launcher.job.moe_model import ExpertLoad, moe_gpt
from tessera.launcher.job.runlog import plot_metrics
from tessera.models import GPT, GPTConfig
from tessera.moe import MoE
from tessera.planner import PRESETS, SearchResult
from tessera.planner.report import summary

CFG = GPTConfig(vocab_size=11, seq_len=8, d_model=8, n_heads=2, n_layers=2, mlp_ratio=2)
CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _moe(**changes: object) -> Config:
    return dataclasses.replace(Config(), moe=MoEConfig(enabled=True, **changes))  # type: ignore[arg-type]


def test_moe_is_off_by_default_and_the_config_file_is_valid() -> None:
    assert not Config().moe.enabled
    config = resolve_config(CONFIGS / "moe.toml", env={})
    assert config.moe.enabled and config.moe.experts == 4 and config.validate() == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"top_k": 5, "experts": 4}, "moe.top_k=5 is more than moe.experts=4"),
        ({"capacity_factor": 0.0}, "moe.capacity_factor=0.0 must be > 0"),
        ({"capacity_factor": -1.5}, "moe.capacity_factor=-1.5 must be > 0"),
        ({"experts": 0, "top_k": 1}, "moe.experts must be >= 1, got 0"),
        ({"aux_loss_coef": -0.1}, "moe.aux_loss_coef=-0.1 must be >= 0"),
        ({"z_loss_coef": -1.0}, "moe.z_loss_coef=-1.0 must be >= 0"),
        ({"expert_hidden": -8}, "moe.expert_hidden must be >= 0, got -8"),
        ({"shared_hidden": -1}, "moe.shared_hidden must be >= 0, got -1"),
    ],
)
def test_bad_moe_sections_are_refused_naming_the_values(changes: dict[str, object], message: str) -> None:
    assert message in _moe(**changes).validate()


def test_compositions_not_built_are_refused() -> None:
    compose = (
        {"tp": 2},
        {"tp": 2, "sequence_parallel": True},
        {"pp": 2},
        {"dp": 2, "ep": 2},
        {"dp": 2, "ep": 2, "tp": 4, "tp_mode": "2d"},  # the experts split over the whole grid
    )
    for degrees in compose:
        ok = dataclasses.replace(_moe(), parallel=ParallelConfig(**degrees))  # type: ignore[arg-type]
        assert not [line for line in ok.validate() if line.startswith("moe.")], ok.validate()
    for degrees, message in [
        ({"cp": 2}, "moe.enabled with parallel.cp=2"),
    ]:
        config = dataclasses.replace(_moe(), parallel=ParallelConfig(**degrees))  # type: ignore[arg-type]
        assert any(line.startswith(message) for line in config.validate()), config.validate()
    ep = dataclasses.replace(Config(), parallel=ParallelConfig(dp=2, ep=2))
    assert "parallel.ep=2 needs moe.enabled: the main job's model has no experts" in ep.validate()
    uneven = dataclasses.replace(_moe(experts=3, top_k=1), parallel=ParallelConfig(dp=2, ep=2))
    assert "moe.experts=3 is not divisible by parallel.ep=2" in uneven.validate()
    # the same top_k off: nothing about [moe] is checked
    assert dataclasses.replace(Config(), moe=MoEConfig(enabled=False, top_k=9)).validate() == []


def test_moe_gpt_replaces_each_mlp_and_keeps_everything_else() -> None:
    moe = MoEConfig(enabled=True, experts=3, top_k=2, capacity_factor=1.0)
    model = moe_gpt(CFG, moe, seed=5)
    dense = GPT(CFG, seed=5)
    layers = [layer.mlp for layer in model.layers]
    assert all(isinstance(m, MoE) and m.num_experts == 3 and m.top_k == 2 for m in layers)
    assert layers[0].experts.w1.shape == (3, 8, 16)  # mlp_ratio * d_model wide
    assert layers[0].aux_loss_coef == moe.aux_loss_coef and layers[0].z_loss_coef == moe.z_loss_coef
    kept = {n: p for n, p in dense.named_parameters() if ".mlp." not in n}
    got = dict(model.named_parameters())
    for name, p in kept.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=0)
    again = moe_gpt(CFG, moe, seed=5)  # the same weights whatever the global RNG did
    torch.manual_seed(123)
    torch.testing.assert_close(dict(again.named_parameters()), got, rtol=0, atol=0)
    assert moe_gpt(CFG, dataclasses.replace(moe, dropless=True), seed=5).layers[0].mlp.capacity_factor is None
    assert type(build_model(CFG, Config(), seed=0).layers[0].mlp).__name__ == "MLP"
    narrow = moe_gpt(CFG, dataclasses.replace(moe, expert_hidden=4, shared_hidden=6), seed=5).layers[0].mlp
    assert narrow.experts.w1.shape == (3, 8, 4) and narrow.shared is not None and narrow.shared.hidden == 6
    assert layers[0].shared is None  # none unless asked


def test_the_planner_sees_the_expert_widths() -> None:
    wide = experts_of(_moe())
    narrow = experts_of(_moe(expert_hidden=32, shared_hidden=64, dropless=True))
    assert wide is not None and wide.hidden == Config().model.mlp_ratio * Config().model.d_model
    assert wide.shared_hidden == 0
    assert narrow is not None and (narrow.hidden, narrow.shared_hidden, narrow.capacity_factor) == (
        32,
        64,
        None,
    )


def _count(rank: int) -> tuple[dict[str, object], list[torch.Tensor]]:
    model = moe_gpt(CFG, MoEConfig(enabled=True, experts=4, top_k=2, capacity_factor=0.5), seed=1)
    load = ExpertLoad(model)
    routed = []
    for step in range(2):
        ids = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(10 * rank + step))
        model(ids)
        routed.append(
            torch.stack([torch.stack([m.mlp.stats.routed, m.mlp.stats.kept]) for m in model.layers])
        )
    model.eval()
    model(ids)  # evaluation is not counted
    out = load.collect(dist.group.WORLD)
    assert load.routed.sum() == 0  # started again
    load.close()
    return out, routed


def test_expert_load_sums_the_training_calls_over_ranks() -> None:
    results = run_threaded(2, _count)
    counts = torch.stack([torch.stack(r).sum(0) for _, r in results]).sum(0)  # [layer, routed|kept, E]
    routed, kept = counts[:, 0].double(), counts[:, 1].double()
    for out, _ in results:
        assert out["expert_share"] == pytest.approx((routed.sum(0) / routed.sum()).tolist(), rel=1e-12)
        for got, r in zip(out["expert_share_by_layer"], routed, strict=True):  # type: ignore[call-overload]
            assert got == pytest.approx((r / r.sum()).tolist(), rel=1e-12)
        assert out["dropped_fraction"] == pytest.approx(1 - float(kept.sum() / routed.sum()), rel=1e-12)
    assert 0 < results[0][0]["dropped_fraction"] < 1  # capacity 0.5 drops some, not all  # type: ignore[operator]


def test_the_plot_has_an_expert_load_panel(tmp_path: Path) -> None:
    records = [
        {
            "step": s,
            "loss": 3.0 - s / 10,
            "tokens_per_s": 100.0,
            "expert_share": [0.5, 0.3, 0.2],
            "dropped_fraction": 0.1,
        }
        for s in (1, 2, 3)
    ]
    plot_metrics(records, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_the_planner_sees_the_experts_and_ep() -> None:
    config = resolve_config(CONFIGS / "moe.toml", env={})
    job, layout = job_of(config), layout_of(config)
    assert job.moe is not None and layout.ep == 2
    assert (job.moe.layers, job.moe.experts, job.moe.top_k) == (2, 4, 2)
    assert job.moe.hidden == config.model.mlp_ratio * config.model.d_model
    assert job.moe.capacity_factor == 1.25
    assert config_of(config, layout).parallel.ep == 2
    assert job_of(Config()).moe is None


def test_the_plan_summary_counts_the_experts_parameters() -> None:
    config = resolve_config(CONFIGS / "moe.toml", env={})
    m = config.model
    model = moe_gpt(
        GPTConfig(128, m.seq_len, m.d_model, m.n_heads, m.n_layers, m.mlp_ratio), config.moe, seed=0
    )
    count = sum(p.numel() for p in model.parameters())
    shape = dataclasses.replace(model_of(config), vocab=128)
    text = summary(SearchResult((), (), 0, 0, 0, 0), shape, PRESETS["cpu"], 2, experts_of(config))
    assert f"4 experts top-2 in 2 layers ({count / 1e6:.4g}M parameters)" in text
