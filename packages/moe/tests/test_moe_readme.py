"""Tiers 0 and 1: the README's examples run as written, and do what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def block(heading: str) -> str:
    """The first python block of the README's section ``heading``."""
    text = README.read_text(encoding="utf-8")
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"the README's section {heading!r} has no python block"
    return match.group(1)


def run(heading: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "readme"}
    exec(compile(block(heading), str(README), "exec"), namespace)
    return namespace


def test_the_readme_expert_parallel_example_runs() -> None:
    assert run("## Expert parallelism")["shapes"] == [torch.Size([2, 16, 32])] * 2


def test_the_readme_tensor_parallel_example_runs() -> None:
    namespace = run("## Tensor parallelism inside the experts")
    assert namespace["shape"] == torch.Size([4, 16, 16])


def test_the_readme_usage_example_runs() -> None:
    namespace = run("## Usage")
    y, x, layer = namespace["y"], namespace["x"], namespace["layer"]
    assert isinstance(y, torch.Tensor) and isinstance(x, torch.Tensor)
    assert y.shape == (2, 6, 16) and x.grad is not None
    stats = layer.stats  # type: ignore[attr-defined]
    assert int(stats.tokens_per_expert.sum()) == 12 * 2
    assert 0.0 <= stats.dropped_fraction < 1.0


def test_the_readme_adapters_example_trains_only_the_adapters() -> None:
    ns = run("## Low-rank adapters")
    layer, out = ns["layer"], ns["out"]
    assert isinstance(layer, torch.nn.Module) and isinstance(out, torch.Tensor)
    out.square().sum().backward()
    trained = {n for n, p in layer.named_parameters() if p.grad is not None}
    assert trained == {
        n for n, _ in layer.named_parameters() if ".adapters." in n or n.startswith("router.adapters")
    }
