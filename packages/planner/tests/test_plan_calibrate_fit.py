"""The calibration's alpha-beta fits refuse timings that cannot be fitted: a large collective
measured no slower than a small one (other work disturbed the small one) is measured again,
and after three such tries the calibration stops naming the times, instead of writing an
absurd bandwidth into the cluster file. Pure: the timings are given, nothing spawns."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tessera.planner import calibrate as cal


def _timings(monkeypatch: pytest.MonkeyPatch, pairs: list[tuple[float, float]]) -> list[str]:
    """Make `_all_reduce_times` answer ``pairs`` in turn; returns the ops it was asked for."""
    answers: Iterator[tuple[float, float]] = iter(pairs)
    asked: list[str] = []

    def fake(world: int, sizes: tuple[int, ...], op: str = "all_reduce") -> list[float]:
        assert world == 2 and sizes == (cal.SMALL, cal.LARGE)
        asked.append(op)
        return list(next(answers))

    monkeypatch.setattr(cal, "_all_reduce_times", fake)
    return asked


def test_a_disturbed_pair_is_measured_again_and_the_fit_uses_the_good_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _timings(monkeypatch, [(4e-3, 2e-3), (1e-4, 1e-4 + (cal.LARGE - cal.SMALL) / 5e9)])
    latency, bandwidth = cal._fit("gloo_all_reduce", 1)
    assert asked == ["gloo_all_reduce", "gloo_all_reduce"]
    assert bandwidth == pytest.approx(5e9, rel=1e-9)
    assert latency == pytest.approx((1e-4 - cal.SMALL / 5e9) / 2, rel=1e-9)


def test_three_disturbed_pairs_stop_the_calibration_naming_the_times(monkeypatch: pytest.MonkeyPatch) -> None:
    _timings(monkeypatch, [(4e-3, 2e-3), (3e-3, 3e-3), (5e-3, 1e-3)])
    with pytest.raises(
        RuntimeError, match=r"all_to_all of 4194304 bytes took 0\.001000 s.*256 bytes \(0\.005000 s\)"
    ):
        cal._all_to_all()
