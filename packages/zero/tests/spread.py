"""Measure the serial-vs-serial spread behind the equivalence tests' tolerances.

Run ``python packages/zero/tests/spread.py``. For the GPT tier's model and optimizers and
for the threaded tier's MLP, one process trains on the full batch and again on per-rank
chunks accumulated in reverse (and, for the GPT under AdamW, in shuffled orders with 1-ulp
gradient noise), and the largest differences of losses, stepped gradients and weights are
printed. Nothing distributed runs: this is round-off alone.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gap(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def gpt_run(kind: str, world: int, order: list[int] | None, noise: int | None = None) -> Any:
    """Losses, stepped gradients and weights; ``order``: chunks accumulated in that order."""
    t = _module("test_zero_gpt")
    model = t.GPT(t.CFG, seed=0)
    opt = t._optimizer(model, kind)
    gen = None if noise is None else torch.Generator().manual_seed(noise)
    losses, grads = [], []
    for step in range(t.STEPS):
        opt.zero_grad()
        if order is None:
            full = model.loss(*t._batch(step))
            full.backward()
            loss = full.item()
        else:
            loss = 0.0
            for r in order:
                part = model.loss(*t._batch(step, r, world)) / world
                part.backward()
                loss += part.item()
        if gen is not None:
            for p in model.parameters():
                p.grad.mul_(1 + 2**-23 * torch.randint(-1, 2, p.shape, generator=gen))
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.CLIP)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def gpt() -> None:
    for kind in ("adamw", "sgd"):
        ref = gpt_run(kind, 1, None)
        loss = grad0 = grads = weights = 0.0
        for world in (2, 4, 8):
            orders = [list(reversed(range(world)))]
            orders += [random.Random(s).sample(range(world), world) for s in range(4)]
            for i, order in enumerate(orders):
                for noise in (None, i) if kind == "adamw" else (None,):
                    run = gpt_run(kind, world, order, noise)
                    loss = max(loss, max(abs(a - b) for a, b in zip(ref[0], run[0], strict=True)))
                    grad0 = max(grad0, _gap(ref[1][0], run[1][0]))
                    grads = max(grads, max(_gap(a, b) for a, b in zip(ref[1], run[1], strict=True)))
                    weights = max(weights, _gap(ref[2], run[2]))
        print(f"GPT {kind}: loss {loss:.2e}, stepped grad step 0 {grad0:.2e}, any step {grads:.2e}, "
              f"weights {weights:.2e}")


def mlp() -> None:
    t = _module("test_zero_threaded")

    def run(case: dict[str, Any], chunked: bool) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        model = t.MLP(0, tie=case["tie"])
        opt = t.make_optimizer(model, case["opt"], case["groups"])
        first: dict[str, Tensor] = {}
        for step in range(3):
            parts = [t.batch(step, r, 0) for r in range(case["world"])]
            opt.zero_grad()
            if chunked:
                for x, y in reversed(parts):
                    (F.mse_loss(model(x), y) / case["world"]).backward()
            else:
                xs, ys = zip(*parts, strict=True)
                F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
            if case["clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
            first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
        return first, {n: p.detach().clone() for n, p in model.named_parameters()}

    for opt in ("sgd", "adam", "adamw"):
        grad0 = weights = 0.0
        for world in (2, 3, 4):
            for groups in (False, True):
                for clip in (None, 0.5):
                    for tie in (False, True):
                        case = {"world": world, "opt": opt, "groups": groups, "clip": clip, "tie": tie}
                        (ga, wa), (gb, wb) = run(case, False), run(case, True)
                        grad0, weights = max(grad0, _gap(ga, gb)), max(weights, _gap(wa, wb))
        print(f"MLP {opt}: stepped grad step 0 {grad0:.2e}, weights after 3 steps {weights:.2e}")


if __name__ == "__main__":
    gpt()
    mlp()
