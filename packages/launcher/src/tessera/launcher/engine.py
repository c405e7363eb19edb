"""The training engine ``boost()`` returns: one train step over dp x pp x tp x ZeRO, eval, state.

A step takes the *global* batch (every rank may pass the same tensors): each data-parallel
rank trains on its rows, in ``parallel.microbatches`` microbatches; the loss is the mean over
the global batch, so a run equals the serial model trained on that batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Mesh, all_reduce, broadcast, recv, send
from tessera.launcher.config import Config
from tessera.pipeline import PipelineRuntime
from tessera.tensor_parallel import sync_sequence_parallel_grads
from tessera.zero import ZeroOptimizer, clip_coefficient

__all__ = ["Engine", "Placement", "StepOutput"]


@dataclass(frozen=True)
class Placement:
    """Where this rank's parameters sit in the serial model."""

    names: dict[nn.Parameter, str]  # serial name of each local parameter
    full_shapes: dict[str, tuple[int, ...]]  # serial shape of every parameter
    replicated: dict[nn.Parameter, int]  # parameters identical on tp ranks -> tp
    stage_to_rank: tuple[int, ...] = field(default=())  # pipeline: rank of every stage


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one training step did: the global-batch loss, gradient norm, learning rate."""

    loss: float
    grad_norm: float | None
    lr: float
    skipped: bool


class Engine:
    """Trains, evaluates, saves and loads one boosted model (see ``boost``)."""

    def __init__(
        self,
        *,
        config: Config,
        mesh: Mesh,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        zero: ZeroOptimizer | None,
        runtime: PipelineRuntime | None,
        scheduler: Any,
        loss_fn: Any,
        placement: Placement,
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.module = module
        self.optimizer = optimizer
        self.zero = zero
        self.runtime = runtime
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.placement = placement
        self.step = 0
        self.tp, self.dp, self.pp = mesh.group("tp"), mesh.group("dp"), mesh.group("pp")

    # ------------------------------------------------------------------ training
    def _local_rows(self, batch: Tensor) -> Tensor:
        dp = self.config.parallel.dp
        if batch.shape[0] % dp:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split over dp={dp}")
        rows = batch.shape[0] // dp
        start = self.mesh.coordinate("dp") * rows
        return batch[start : start + rows].to(self.mesh.device)

    def _forward_loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self.loss_fn(self.module(inputs), targets)  # type: ignore[no-any-return]

    def train_step(self, inputs: Tensor, targets: Tensor) -> StepOutput:
        """One optimizer step on the global batch ``(inputs, targets)``; collective."""
        self.module.train()
        x, y = self._local_rows(inputs), self._local_rows(targets)
        m = self.config.parallel.microbatches
        if self.runtime is not None:
            first = self.runtime.schedule.stage_to_rank[0] == self.mesh.coordinate("pp")
            last = self.runtime.schedule.stage_to_rank[-1] == self.mesh.coordinate("pp")
            result = self.runtime.step(x if first else None, y if last else None, broadcast_loss=True)
            assert result.loss is not None
            local_loss = result.loss
        else:
            if x.shape[0] % m:
                raise ValueError(
                    f"{x.shape[0]} rows per data-parallel rank do not split into {m} microbatches"
                )
            total = 0.0
            for i, (xb, yb) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
                loss = self._forward_loss(xb, yb)
                total += float(loss.detach())
                if self.zero is None:
                    (loss / m).backward()  # type: ignore[no-untyped-call]
                elif i < m - 1:
                    with self.zero.no_sync():
                        self.zero.backward(loss / m)
                else:
                    self.zero.backward(loss / m)
            local_loss = total / m
        if self.config.parallel.sequence_parallel:
            sync_sequence_parallel_grads(self.module, self.tp)
        skipped, norm = self._apply_gradients()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        loss_t = all_reduce(
            torch.tensor([local_loss], dtype=torch.float64, device=self.mesh.device), self.dp, "avg"
        )
        return StepOutput(float(loss_t[0]), norm, lr, skipped)

    def _apply_gradients(self) -> tuple[bool, float | None]:
        if self.zero is not None:
            stepped = self.zero.step()
            return (not stepped), self.zero.last_grad_norm
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.config.parallel.dp > 1 and params:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            all_reduce(flat, self.dp, "avg", inplace=True)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        norm = self._global_norm(params)
        clip = self.config.optim.clip_grad_norm
        if clip > 0 and math.isfinite(norm):
            coef = clip_coefficient(norm, clip)
            for p in params:
                p.grad.mul_(coef)  # type: ignore[union-attr]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return False, norm

    def _global_norm(self, params: list[nn.Parameter]) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for p in params:
            weight = 1.0 / self.placement.replicated.get(p, 1)
            sq += weight * p.grad.detach().double().pow(2).sum()  # type: ignore[union-attr]
        for group, n in ((self.tp, self.config.parallel.tp), (self.pp, self.config.parallel.pp)):
            if n > 1:
                sq = all_reduce(sq.reshape(1), group).reshape(())
        return math.sqrt(float(sq))

    # ------------------------------------------------------------------ state
    def save(self, path: str | Path) -> None:
        """Checkpoint model, optimizer, scheduler, RNG and data position (collective)."""
        from tessera.launcher.checkpoint import save_engine

        save_engine(self, path)

    def load(self, path: str | Path) -> None:
        """Resume from ``save``'s checkpoint at the same topology (collective)."""
        from tessera.launcher.checkpoint import load_engine

        load_engine(self, path)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_loss(self, inputs: Tensor, targets: Tensor) -> float:
        """The mean loss on the global batch, without updating anything; collective."""
        self.module.eval()
        x, y = self._local_rows(inputs), self._local_rows(targets)
        with self.zero.gathered() if self.zero is not None else contextlib.nullcontext():
            local = float(self._forward_loss(x, y)) if self.runtime is None else self._pipeline_forward(x, y)
        out = all_reduce(torch.tensor([local], dtype=torch.float64, device=self.mesh.device), self.dp, "avg")
        return float(out[0])

    def _pipeline_forward(self, x: Tensor, y: Tensor) -> float:
        """Forward only, stage after stage over the pipeline group; the loss is broadcast."""
        assert self.runtime is not None
        me = self.mesh.coordinate("pp")
        owner = self.placement.stage_to_rank
        act: Tensor | None = x
        loss = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
        p = self.config.parallel
        seq = self.config.model.seq_len // (p.tp if p.sequence_parallel else 1)
        like = torch.empty(
            x.shape[0],
            seq,
            self.config.model.d_model,
            device=self.mesh.device,
            dtype=next(self.module.parameters()).dtype,
        )
        for s in range(len(owner)):
            if owner[s] != me:
                continue
            if s > 0 and owner[s - 1] != me:
                act = recv(like, owner[s - 1], self.pp)
            assert act is not None
            act = self.runtime.stages[s](act)
            if s + 1 < len(owner) and owner[s + 1] != me:
                send(act, owner[s + 1], self.pp)
            elif s + 1 == len(owner):
                loss[0] = float(self.loss_fn(act, y))
        return float(broadcast(loss, owner[-1], self.pp)[0])
