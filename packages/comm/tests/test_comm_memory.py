"""Tier 0: the memory meter counts storages once; the rank filter lets rank 0 speak.

(The reference GPT's own tests live in packages/models/tests: comm declares no model.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.comm import measure_memory, storage_bytes


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
