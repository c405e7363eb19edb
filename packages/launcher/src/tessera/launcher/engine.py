"""The training engine ``boost()`` returns: one train step over dp x pp x tp x ZeRO, eval, state.

A step takes the *global* batch (every rank may pass the same tensors): each data-parallel
rank trains on its rows, in ``parallel.microbatches`` microbatches; the loss is the mean over
the global batch, so a run equals the serial model trained on that batch. Degrees come from
the mesh, activation shapes from the model; gradient averaging, clipping and the optimizer
step are the `ZeroOptimizer`'s (stage 0 is plain data parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Mesh, all_reduce
from tessera.launcher.checkpoint import load_engine, save_engine
from tessera.launcher.config import Config
from tessera.launcher.consolidate import consolidate, local_full_parameters
from tessera.launcher.placement import Placement
from tessera.pipeline import PipelineRuntime, forward_loss
from tessera.tensor_parallel import sync_sequence_parallel_grads
from tessera.zero import ZeroOptimizer

__all__ = ["Engine", "StepOutput"]


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
        zero: ZeroOptimizer,
        runtime: PipelineRuntime | None,
        scheduler: Any,
        loss_fn: Any,
        placement: Placement,
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.module = module
        self.zero = zero
        self.runtime = runtime
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.placement = placement
        self.step = 0
        self.tp, self.dp, self.pp = mesh.group("tp"), mesh.group("dp"), mesh.group("pp")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer ZeRO steps (its param groups hold this rank's shards)."""
        return self.zero.optimizer

    # ------------------------------------------------------------------ training
    def _local_rows(self, batch: Tensor) -> Tensor:
        dp = self.mesh.size("dp")
        if batch.shape[0] % dp:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split over dp={dp}")
        rows = batch.shape[0] // dp
        start = self.mesh.coordinate("dp") * rows
        return batch[start : start + rows].to(self.mesh.device)

    def _forward_loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self.loss_fn(self.module(inputs), targets)  # type: ignore[no-any-return]

    def _is_stage_owner(self, stage: int) -> bool:
        return self.placement.stage_to_rank[stage] == self.mesh.coordinate("pp")

    def train_step(self, inputs: Tensor, targets: Tensor) -> StepOutput:
        """One optimizer step on the global batch ``(inputs, targets)``; collective."""
        self.module.train()
        x, y = self._local_rows(inputs), self._local_rows(targets)
        if self.runtime is not None:
            first, last = self._is_stage_owner(0), self._is_stage_owner(-1)
            result = self.runtime.step(x if first else None, y if last else None, broadcast_loss=True)
            assert result.loss is not None
            local_loss = result.loss
        else:
            local_loss = self._accumulate(x, y)
        if self.config.parallel.sequence_parallel:
            sync_sequence_parallel_grads(self.module, self.tp)
        stepped = self.zero.step()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        loss_t = all_reduce(
            torch.tensor([local_loss], dtype=torch.float64, device=self.mesh.device), self.dp, "avg"
        )
        return StepOutput(float(loss_t[0]), self.zero.last_grad_norm, lr, not stepped)

    def _accumulate(self, x: Tensor, y: Tensor) -> float:
        """Forward and backward of ``parallel.microbatches`` microbatches; their mean loss."""
        m = self.config.parallel.microbatches
        if x.shape[0] % m:
            raise ValueError(f"{x.shape[0]} rows per data-parallel rank do not split into {m} microbatches")
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            loss = self._forward_loss(xb, yb)
            total += float(loss.detach())
            if i < m - 1:
                with self.zero.no_sync():
                    self.zero.backward(loss / m)
            else:
                self.zero.backward(loss / m)
        return total / m

    # ------------------------------------------------------------------ state
    def save(self, path: str | Path) -> None:
        """Checkpoint model, optimizer, scheduler, RNG and data position (collective)."""
        save_engine(self, self.step, path)

    def load(self, path: str | Path) -> None:
        """Resume from ``save``'s checkpoint at the same topology (collective)."""
        self.step = load_engine(self, path)

    def full_state_dict(self) -> dict[str, Tensor]:
        """This rank's pipeline stages as full fp32 serial tensors by serial name (collective
        over tp and dp; with pp > 1 each pipeline rank gets only its stages' parameters)."""
        return local_full_parameters(self)

    def consolidate(self, path: str | Path) -> dict[str, Tensor] | None:
        """Write the serial model's state dict to ``path``; rank 0 also returns it (collective)."""
        return consolidate(self, path)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_loss(self, inputs: Tensor, targets: Tensor) -> float:
        """The mean loss on the global batch, without updating anything; collective."""
        self.module.eval()
        x, y = self._local_rows(inputs), self._local_rows(targets)
        with self.zero.gathered():
            if self.runtime is None:
                local = float(self._forward_loss(x, y))
            else:
                stages, owners, device = self.runtime.stages, self.placement.stage_to_rank, self.mesh.device
                local = forward_loss(stages, owners, x, y, self.loss_fn, group=self.pp, device=device)
        out = all_reduce(torch.tensor([local], dtype=torch.float64, device=self.mesh.device), self.dp, "avg")
        return float(out[0])
