"""How far an Adam-trained parallel run may drift from serial, derived from the optimizer.

Adam(W) steps each element by ``lr * m / (sqrt(v) + eps)``: about ``lr * sign(g)`` whatever
the gradient's size. Where round-off changes a gradient of about 1e-8 (one that rounds to a
different sign or size when summed in another order, as a ring, a tree or serial code do),
that element can be stepped differently by up to twice Adam's largest step, on any machine.
Elementwise, only that envelope holds everywhere, and it is too wide to catch bugs. But
round-off reaches few elements (those whose gradient is small against its round-off), and
moves most others by about ``lr`` times a relative round-off, while a wrong shard, a lost or
doubled contribution moves many elements by about ``lr`` a step. So the bound is:

- every element within ``envelope = 2 * steps * max_step`` of serial, where Adam's largest
  step is ``lr * max(1, (1 - beta1) / sqrt(1 - beta2))`` (Kingma and Ba, section 2.1);
- in each tensor, the mean elementwise distance at most ``mean_fraction * envelope / 2``
  (by default 1/1000 of the farthest one run can travel).

Measured on the composition tests (AdamW, lr 1e-2, 4 steps, dp x tp with ZeRO-1/3): per
tensor the median distance is 1e-7 to 5e-7, the largest 4e-5 (up to 5% of a key projection's
elements beyond 1e-5), the mean bound 4e-5. Exact comparisons belong to gradients and to
weights trained with SGD, which is linear in the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["adam_envelope", "assert_adam_close"]


def adam_envelope(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest elementwise distance two Adam runs of ``steps`` steps can reach."""
    beta1, beta2 = betas
    return 2.0 * steps * lr * max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2))


def assert_adam_close(
    got: Mapping[str, Tensor],
    want: Mapping[str, Tensor],
    *,
    lr: float,
    steps: int,
    betas: tuple[float, float] = (0.9, 0.999),
    mean_fraction: float = 1e-3,
) -> None:
    """Assert Adam-trained weights ``got`` match ``want`` within the bound of the module docstring."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    envelope = adam_envelope(lr, steps, betas)
    torch.testing.assert_close(dict(got), dict(want), rtol=0.0, atol=envelope)
    limit = mean_fraction * envelope / 2
    means = {name: float((got[name] - w).abs().mean()) for name, w in want.items()}
    beyond = {name: f"mean distance {m:.3g} > {limit:.3g}" for name, m in means.items() if m > limit}
    assert not beyond, beyond
