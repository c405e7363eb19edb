"""Tier 0: the README's usage example runs as written, and does what its comments say."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def usage_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Usage", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README's Usage section has no python block"
    return match.group(1)


def test_the_readme_usage_example_runs() -> None:
    namespace: dict[str, object] = {}
    exec(compile(usage_block(), str(README), "exec"), namespace)
    y, x, layer = namespace["y"], namespace["x"], namespace["layer"]
    assert isinstance(y, torch.Tensor) and isinstance(x, torch.Tensor)
    assert y.shape == (2, 6, 16) and x.grad is not None
    stats = layer.stats  # type: ignore[attr-defined]
    assert int(stats.tokens_per_expert.sum()) == 12 * 2
    assert 0.0 <= stats.dropped_fraction < 1.0
