"""Test support: a model trained a few SGD steps, its tensor-parallel twin's shards gathered by
the recorded shard specs, and the comparison of the two (used by the 2D, 2.5D and 3D tests).

Tolerances of ``assert_follows_serial`` (fp32): first-step gradients ``rtol=1e-4``, ``atol=1e-5``
times the largest serial gradient of that parameter (floored at 1e-2: some gradients, e.g.
the key biases, are zero in exact arithmetic and hold only round-off); losses ``rtol=1e-5``;
the weights after the steps ``rtol=1e-5``, ``atol=1e-6`` (they are O(0.02-1) and move by lr
times gradients that agree to the bound above). The parallel model adds the same products
in another order (partial sums over the grid's lines) through every layer, which compounds a
few ulps per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from tessera.comm import Group, all_gather
from tessera.tensor_parallel.parallelize import shard_specs
from tessera.tensor_parallel.partition import ShardSpec

__all__ = ["Curve", "assert_follows_serial", "gather_by_specs", "sgd_curve"]

Curve = tuple[list[float], dict[str, Tensor], dict[str, Tensor]]
"""(losses per step, first-step gradients by name, final weights by name)."""


def sgd_curve(model: nn.Module, loss_of: Callable[[nn.Module], Tensor], *, steps: int, lr: float) -> Curve:
    """Train ``model`` ``steps`` SGD steps on ``loss_of(model)``; its curve, with the weights as
    the model holds them (shards, for a parallel model)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model)
        torch.autograd.backward(loss)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def gather_by_specs(model: nn.Module, weights: dict[str, Tensor], group: Group, tp: int) -> dict[str, Tensor]:
    """Full tensors of a parallel model's shards, by consolidation's path: all-gather each over
    the tp ``group`` along its spec's ``local_dim``, then ``unshard`` one chunk per rank."""
    specs = shard_specs(model)
    return {
        n: specs[n].unshard(all_gather(w, group, specs[n].local_dim).chunk(tp, specs[n].local_dim))
        for n, w in weights.items()
    }


def assert_follows_serial(
    serial: Curve, ranks: Sequence[tuple[Curve, dict[str, Tensor]]], specs: dict[str, ShardSpec]
) -> None:
    """Every rank's ``(curve, gathered weights)`` against the serial curve (module docstring):
    the first-step gradients unsharded by ``specs`` (every parameter split), the losses of
    every step, and the final weights."""
    serial_losses, serial_grads, serial_weights = serial
    assert set(specs) == set(serial_grads)  # every parameter of the model is split
    assert all(set(curve[1]) == set(serial_grads) for curve, _ in ranks)
    for name, want in serial_grads.items():
        got = specs[name].unshard([curve[1][name] for curve, _ in ranks])
        scale = max(want.abs().max().item(), 1e-2)
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
        except AssertionError as error:
            error.add_note(f"in the gradient of {name}")
            raise
    for (losses, _, _), weights in ranks:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(serial_losses), rtol=1e-5, atol=0.0)
        for name, want in serial_weights.items():
            try:
                torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the weight {name} after {len(losses)} SGD steps, gathered")
                raise
    assert serial_losses[-1] < serial_losses[0]  # the steps do train
