"""The single-process throughput reference of the main job (``serial_speed``)."""

from __future__ import annotations

import os

import pytest
import torch

from tessera.launcher.job.serial_speed import best_serial_tokens_per_s, serial_tokens_per_s


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.out = torch.nn.Linear(8, 11)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.emb(idx))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    x = torch.randint(0, 11, (3, 5), generator=gen)
    return x, x.roll(1, dims=1)


def test_times_training_steps_and_restores_the_thread_count() -> None:
    """It trains the model (the weights move), counts the timed tokens and leaves torch's thread
    count as it found it."""
    torch.manual_seed(0)
    model = _Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    threads = torch.get_num_threads()
    speed = serial_tokens_per_s(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        _batch,
        device=torch.device("cpu"),
        clip_grad_norm=1.0,
        warmup=1,
        steps=3,
        threads=1,
    )
    assert speed.tokens_per_s > 0 and speed.threads == 1 and speed.steps == 3
    assert torch.get_num_threads() == threads
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_rejects_no_timed_steps() -> None:
    model = _Tiny()
    with pytest.raises(ValueError, match="steps=0"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        serial_tokens_per_s(model, optimizer, _batch, device=torch.device("cpu"), steps=0)


def test_best_of_one_thread_and_every_core() -> None:
    """The reference is one of the two timings: one thread or every core, with fresh models."""
    made: list[_Tiny] = []

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        made.append(_Tiny())
        return made[-1], torch.optim.AdamW(made[-1].parameters(), lr=1e-2)

    speed = best_serial_tokens_per_s(make, _batch, device=torch.device("cpu"))
    counts = sorted({1, os.cpu_count() or 1})
    assert len(made) == len(counts) and speed.threads in counts and speed.tokens_per_s > 0
