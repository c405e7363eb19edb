"""Tier 0: the memory meter counts storages once, and the reference GPT is deterministic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.comm import measure_memory, storage_bytes
from tessera.models import GPT, GPTConfig, make_batch


@settings(max_examples=30)
@given(st.integers(1, 64), st.integers(1, 8), st.sampled_from([torch.float32, torch.bfloat16]))
def test_views_are_counted_once(numel: int, views: int, dtype: torch.dtype) -> None:
    base = torch.zeros(numel, dtype=dtype)
    parts = [base[i % numel :] for i in range(views)] + [base.view(1, numel)]
    assert storage_bytes(parts) == numel * base.element_size()
    other = torch.zeros(numel, dtype=dtype)
    assert storage_bytes([*parts, other]) == 2 * numel * base.element_size()


def test_adam_model_state_is_16_bytes_per_parameter() -> None:
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    report = measure_memory(modules=[model], optimizers=[opt])
    n_tensors = len(list(model.parameters()))
    assert report.parameters == 4 * psi
    assert report.gradients == 4 * psi
    # exp_avg and exp_avg_sq (8 bytes per parameter) plus one fp32 step counter per tensor
    assert report.optimizer_state == 8 * psi + 4 * n_tensors
    assert report.model_state == 16 * psi + 4 * n_tensors
    assert report.by_device == {"cpu": report.total}


def test_shared_parameters_count_once() -> None:
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.weight = a.weight  # tied
    report = measure_memory(modules=[a, b])
    assert report.parameters == 4 * (16 + 4 + 4)


def test_gpt_is_deterministic_and_its_blocks_compose() -> None:
    cfg = GPTConfig(n_layers=3)
    a, b = GPT(cfg, seed=3), GPT(cfg, seed=3)
    torch.manual_seed(123)  # the global RNG plays no part in the init
    c = GPT(cfg, seed=3)
    for (_, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb) and torch.equal(pa, pc)
    idx, targets = make_batch(cfg, 4, seed=0)
    assert idx.shape == targets.shape == (4, cfg.seq_len)
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    x = idx
    for block in a.blocks():
        x = block(x)
    assert torch.equal(x, a(idx))
    assert x.shape == (4, cfg.seq_len, cfg.vocab_size)
    assert not torch.equal(GPT(cfg, seed=4).head.lm_head.weight, a.head.lm_head.weight)
    loss = a.loss(idx, targets)
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5


def test_gpt_config_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        GPTConfig(d_model=30)


def _log_from_every_rank(rank: int) -> None:
    import logging

    logging.getLogger("tessera.test").info("info from %d", rank)
    logging.getLogger("tessera.test").warning("warning from %d", rank)


def test_rank_filter_lets_rank_zero_speak(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tessera.comm import RankFilter
    from tessera.comm.testing import run_threaded

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.rank}:{record.getMessage()}")  # type: ignore[attr-defined]

    handler = Keep()
    handler.addFilter(RankFilter())
    logger = logging.getLogger("tessera")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run_threaded(2, _log_from_every_rank)
    finally:
        logger.removeHandler(handler)
    assert sorted(seen) == ["0:info from 0", "0:warning from 0", "1:warning from 1"]
