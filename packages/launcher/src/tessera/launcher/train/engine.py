"""The training engine ``boost()`` returns: one train step over dp x pp x tp x ZeRO, eval, state.

A step takes the *global* batch (every rank may pass the same tensors): each data-parallel
rank trains on its rows, in ``parallel.microbatches`` microbatches; the loss is the mean over
the global batch (per counted token with the built-in cross-entropy, targets of -100
counting for nothing: ``tessera.launcher.train.objective``), so a run equals the serial model
trained on that batch. A loop that reads only its rank's rows (``Engine.local_rows``;
``Engine.batch_needs``: a pipeline's middle stages read nothing) passes them with
``local=True``: the same rows train, bit for bit.
Degrees come from the mesh, activation shapes from the model; gradient averaging, clipping
and the optimizer step are the `ZeroOptimizer`'s (stage 0 is plain data parallelism).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Mesh, all_gather, all_reduce
from tessera.comm.consensus import raise_together
from tessera.launcher.checkpoint.adapter_files import export_merged, save_adapter
from tessera.launcher.checkpoint.consolidate import (
    MAX_SHARD_BYTES,
    consolidate,
    export_sharded,
    local_full_parameters,
)
from tessera.launcher.checkpoint.dcp import export_dcp, import_dcp
from tessera.launcher.checkpoint.engine_io import BackgroundSave, load_engine, save_engine
from tessera.launcher.checkpoint.placement import Placement
from tessera.launcher.checkpoint.reshard import import_weights
from tessera.launcher.checkpoint.storage import Storage, probe_storage
from tessera.launcher.config import BoostConfig
from tessera.launcher.families.spec import logits_of
from tessera.launcher.train.batches import Inputs, split_inputs
from tessera.launcher.train.objective import IGNORE_INDEX, Objective, StepLoss
from tessera.launcher.train.verify import Verifier
from tessera.moe import balance_choice_biases, set_aux_grad_scale
from tessera.pipeline import PipelineRuntime, forward_loss, split_microbatches
from tessera.tensor_parallel import (
    sequence_parallel_params,
    sync_sequence_parallel_grads,
    tp_gradient_problems,
)
from tessera.zero import ZeroOptimizer

__all__ = ["Diverged", "Engine", "Inputs", "StepOutput"]

log = logging.getLogger(__name__)


class Diverged(RuntimeError):
    """Raised on every rank when training went non-finite for more steps in a row than allowed."""


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
        config: BoostConfig,
        mesh: Mesh,
        module: nn.Module,
        zero: ZeroOptimizer,
        runtime: PipelineRuntime | None,
        scheduler: Any,
        objective: Objective,
        placement: Placement,
        output: Callable[[Any], Tensor] = logits_of,
        tied: Sequence[tuple[str, nn.Parameter, bool]] = (),
        max_skipped_steps: int = 20,
        verifier: Verifier | None = None,
        step_loss: StepLoss | None = None,
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.module = module
        self.zero = zero
        self.runtime = runtime
        self.scheduler = scheduler
        self.objective = objective
        # what each microbatch trains on (the pipeline runtime's loss function is the same one)
        self.step_loss = step_loss if step_loss is not None else StepLoss(objective)
        self.output = output
        self.tied = list(tied)  # (serial name, parameter, held by this rank) across pipeline ranks
        self.placement = placement
        self.step = 0
        self.max_skipped_steps = max_skipped_steps
        self.skipped_in_a_row = 0
        self.verifier = verifier  # boost(verify=True): the first step is compared with a serial one
        self.tp, self.dp, self.pp = mesh.group("tp"), mesh.group("dp"), mesh.group("pp")
        # whole parameters whose gradients are partial sums over tp (parallelize's coverage):
        # summed after every backward; the first step also proves the rule (``_prove_coverage``)
        self.partial_over_tp = bool(sequence_parallel_params(module))
        self.coverage_proved = mesh.size("tp") == 1
        self._pending_save: BackgroundSave | None = None  # save(background=True) until committed
        self._storage: dict[Path, Storage] = {}  # checkpoint folder -> which ranks share it

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer ZeRO steps (its param groups hold this rank's shards)."""
        return self.zero.optimizer

    # ------------------------------------------------------------------ training
    def local_rows(self, batch_size: int) -> range:
        """The rows of a global batch of ``batch_size`` rows that this rank trains on: its
        data-parallel replica's block, the same rows on the tp / cp / pp ranks of a replica.
        A loop that reads only these rows passes them with ``local=True``."""
        dp = self.mesh.size("dp")
        if batch_size % dp:
            raise ValueError(f"batch of {batch_size} rows does not split over dp={dp}")
        rows = batch_size // dp
        start = self.mesh.coordinate("dp") * rows
        return range(start, start + rows)

    @property
    def batch_needs(self) -> tuple[bool, bool]:
        """Whether this rank's ``train_step`` and ``eval_loss`` read the (inputs, targets).
        Both without a pipeline; with one, the inputs on the rank of the first stage and the
        targets on the rank of the last, so a middle stage reads neither (with ``local=True``
        a rank passes None for what it does not read); both on every rank while
        ``boost(verify=True)``'s first step is pending (its serial copy trains on the whole
        batch, gathered over dp)."""
        if self.runtime is None or self.verifier is not None:
            return True, True
        return self._is_stage_owner(0), self._is_stage_owner(-1)

    def _local_batch(
        self, inputs: Inputs | None, targets: Tensor | None, local: bool, *, parts: int
    ) -> tuple[Inputs | None, Tensor | None]:
        """This rank's part of the batch: its dp rows (``local``: the rows given are they),
        then its tp-mode / cp share; the rows' targets are counted first (``_count``, for
        ``parts`` microbatches per replica). Keyword inputs (a mapping such as
        ``{"input_ids": ..., "attention_mask": ...}``) are split by rows only, so they need a
        mode whose ranks see whole rows (1D tp, no cp, no pp)."""
        needs = self.batch_needs
        for name, given, needed in (("inputs", inputs, needs[0]), ("targets", targets, needs[1])):
            if given is None and (needed or not local):
                where = f"rank {self.mesh.rank} ({self.mesh.topology.describe()})"
                raise ValueError(f"{where} reads the {name} of the batch; got None")
        if not local:
            assert targets is not None and inputs is not None
            rows = self.local_rows(targets.shape[0])
            targets = targets[rows.start : rows.stop]
            inputs = (
                inputs[rows.start : rows.stop]
                if isinstance(inputs, Tensor)
                else {k: v[rows.start : rows.stop] for k, v in inputs.items()}
            )
        y = None if targets is None else targets.to(self.mesh.device)
        self._count(y, self.mesh.size("dp") * parts)
        if not isinstance(inputs, Mapping):
            return self._shard(None if inputs is None else inputs.to(self.mesh.device), y, parts)
        topology = self.mesh.topology
        if self.runtime is not None or topology.cp > 1 or not topology.tp_mode.whole_rows:
            raise ValueError(
                f"keyword inputs ({', '.join(inputs)}) with {topology.describe()}: only whole-row modes "
                "take them (1D tp, dp, ZeRO); pass one tensor of inputs"
            )
        return {k: v.to(self.mesh.device) for k, v in inputs.items()}, y

    def _shard(
        self, x: Tensor | None, y: Tensor | None, parts: int = 1
    ) -> tuple[Tensor | None, Tensor | None]:
        """The objective's share of ``x`` and ``y``, microbatch by microbatch (``parts``), so
        that this rank's microbatch j is its share of the replica's microbatch j: the rows one
        call of the serial model sees, which per-call statistics (an MoE layer's capacity and
        router losses) need where the mode splits the rows (2D, 2.5D, 3D). Every objective shards
        each tensor on its own, so a pipeline rank that holds one of them shards it alone."""
        if parts > 1 and not self.mesh.topology.tp_mode.whole_rows:
            shares = [self._shard(a, b) for a, b in zip(_parts(x, parts), _parts(y, parts), strict=True)]
            return _joined([a for a, _ in shares]), _joined([b for _, b in shares])
        if x is not None and y is not None:
            return self.objective.shard(x, y)
        if x is not None:
            return self.objective.shard(x, x)[0], None
        return None, (None if y is None else self.objective.shard(y, y)[1])

    def _global_batch(
        self, inputs: Inputs | None, targets: Tensor | None, local: bool
    ) -> tuple[Inputs, Tensor]:
        """The global batch, for the verified step's serial copy: as given, or (``local``)
        gathered over dp from every replica's rows in replica order."""
        if inputs is None or targets is None:  # batch_needs asks both while verifying
            raise ValueError("the verified first step reads the inputs and the targets; got None")
        if not local:
            return inputs, targets

        def gather(t: Tensor) -> Tensor:
            return all_gather(t.to(self.mesh.device), self.dp)

        x = gather(inputs) if isinstance(inputs, Tensor) else {k: gather(v) for k, v in inputs.items()}
        return x, gather(targets)

    def _forward_loss(self, inputs: Inputs, targets: Tensor) -> Tensor:
        out = self.module(**inputs) if isinstance(inputs, Mapping) else self.module(inputs)
        return self.step_loss(self.output(out), targets)

    def _count(self, targets: Tensor | None, parts: int) -> None:
        """Before a step of ``parts`` (replicas x microbatches) or an evaluation: make the
        objective's sums the mean per counted token of the whole batch (`StepLoss.share`),
        from ``targets``, this replica's rows, counted and summed over dp. Only where this
        rank computes losses (every rank without a pipeline, the last stage's with one),
        which every rank of its dp group does alike."""
        if not self.objective.sums or targets is None:
            return
        if self.runtime is not None and not self._is_stage_owner(-1):
            return
        counted = (targets != IGNORE_INDEX).sum().to(torch.float64).reshape(1)  # on the mesh's device
        total = all_reduce(counted, self.dp)
        self.step_loss.share(float(total[0]), parts)

    def _is_stage_owner(self, stage: int) -> bool:
        return self.placement.stage_to_rank[stage] == self.mesh.coordinate("pp")

    def train_step(self, inputs: Inputs | None, targets: Tensor | None, *, local: bool = False) -> StepOutput:
        """One optimizer step on the global batch ``(inputs, targets)`` (``local``: on this
        rank's rows of it, ``local_rows``; None for what ``batch_needs`` says it does not
        read); collective. A step with a non-finite gradient norm is skipped; too many in a
        row raise `Diverged`."""
        self.module.train()
        if self.verifier is not None:
            whole_x, whole_y = self._global_batch(inputs, targets, local)
            self.verifier.serial_step(self, whole_x, whole_y)
        x, y = self._local_batch(inputs, targets, local, parts=self.config.parallel.microbatches)
        # MoE layers that train their router losses inside their backward (aux_loss_coef) weigh
        # them as the backward weighs each microbatch's loss: the loss scale over the microbatches
        set_aux_grad_scale(self.module, self.zero.loss_scale / self.config.parallel.microbatches)
        # a pipeline runs many backwards in its schedule's order, and partial gradients (norms
        # in the sequence-parallel stream, ...) are summed over tp first: both reduce once, at
        # the step, in every stage
        one_reduction = self.runtime is not None or self.partial_over_tp or not self.coverage_proved
        with self.zero.accumulating() if one_reduction else contextlib.nullcontext():
            if self.runtime is not None:
                assert not isinstance(x, Mapping)  # _local_batch refuses keyword inputs with pp
                first, last = self._is_stage_owner(0), self._is_stage_owner(-1)
                result = self.runtime.step(
                    x if first else None,
                    y if last else None,
                    broadcast_loss=True,
                    loss_scale=self.zero.loss_scale,
                )
                assert result.loss is not None
                local_loss = result.loss
                self._sum_tied_gradients()
            else:
                assert x is not None and y is not None  # batch_needs: both without a pipeline
                local_loss = self._accumulate(x, y)
            if not self.coverage_proved:
                self._prove_coverage()
            if self.partial_over_tp:
                sync_sequence_parallel_grads(self.module, self.tp)
        with self.verifier.comparing(self, local_loss) if self.verifier else contextlib.nullcontext():
            stepped = self.zero.step()
        # MoE routers balanced without a loss (bias_rate): their choice biases follow the load
        # of this step's tokens over every replica (tp ranks route the same tokens)
        balance_choice_biases(self.module, self.dp, step=stepped)
        if self.verifier is not None and self.verifier.done:
            self.verifier = None  # the serial copy is dropped
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        loss_t = all_reduce(
            torch.tensor([local_loss], dtype=torch.float64, device=self.mesh.device), self.dp, "avg"
        )
        out = StepOutput(float(loss_t[0]), self.zero.last_grad_norm, lr, not stepped)
        self._watch_divergence(out)
        return out

    def _prove_coverage(self) -> None:
        """On the first backward, before partial gradients are summed: every whole parameter's
        gradient is complete (the same on every tp rank) or tagged partial, never otherwise;
        a ValueError on every rank naming the parameters if not (no weight has changed yet)."""
        split = self.placement.shard_specs
        named = {self.placement.names[p]: p for p in self.module.parameters()}
        whole = {n: p for n, p in named.items() if n not in split}
        problems = tp_gradient_problems(whole, self.tp)
        error = None
        if problems:
            error = ValueError(
                f"the tensor-parallel plan leaves gradients wrong ({len(problems)} parameters); "
                "nothing was updated: " + "; ".join(problems[:8])
            )
        raise_together(error, None, "checking the tensor-parallel gradients", self.mesh.device)
        self.coverage_proved = True

    def _sum_tied_gradients(self) -> None:
        """A weight tied across pipeline ranks (embedding and LM head) gets each holder's
        gradient summed over the pipeline group, so every copy steps alike (ranks that do not
        hold it add zeros; one all-reduce per tied weight, in name order on every rank)."""
        for _, param, held in self.tied:
            grad = param.grad if held and param.grad is not None else torch.zeros_like(param)
            summed = all_reduce(grad, self.pp)
            if not held:
                continue
            if param.grad is None:
                param.grad = summed
            else:
                param.grad.copy_(summed)

    def _watch_divergence(self, out: StepOutput) -> None:
        """Count steps in a row that ZeRO skipped (a non-finite gradient norm: an fp16 overflow
        or a divergence) or whose loss is not finite; past ``max_skipped_steps`` raise
        `Diverged` (every rank sees the same global norm and loss, so all raise together)."""
        if not out.skipped and math.isfinite(out.loss):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        log.warning(
            "step %d: loss %s, gradient norm %s: %s (%d in a row, at most %d allowed)",
            self.step,
            out.loss,
            out.grad_norm,
            "update skipped" if out.skipped else "non-finite loss",
            self.skipped_in_a_row,
            self.max_skipped_steps,
        )
        if self.skipped_in_a_row > self.max_skipped_steps:
            raise Diverged(
                f"training diverged: {self.skipped_in_a_row} steps in a row up to step {self.step} had a "
                f"non-finite loss or gradient norm (loss {out.loss}, norm {out.grad_norm}); the weights "
                "are those of the last finite step"
            )

    def _accumulate(self, x: Inputs, y: Tensor) -> float:
        """Forward and backward of ``parallel.microbatches`` microbatches; their mean loss."""
        m = self.config.parallel.microbatches
        ys = split_microbatches(y, m, "targets per data-parallel rank")
        total = 0.0
        for i, (xb, yb) in enumerate(zip(split_inputs(x, m), ys, strict=True)):
            loss = self._forward_loss(xb, yb)
            total += float(loss.detach())
            if i < m - 1:
                with self.zero.no_sync():
                    self.zero.backward(loss / m)
            else:
                self.zero.backward(loss / m)
        return total / m

    # ------------------------------------------------------------------ state
    def save(self, path: str | Path, *, keep_last: int = 2, background: bool = False) -> Path:
        """Checkpoint model, optimizer, scheduler, RNG and data position as a new generation
        under ``path`` and return its directory; refuses (on every rank) weights that are not
        finite. Collective. A save pending in the background is committed first.
        ``background``: return once the state is copied to host memory and write it in a
        thread while training goes on; it is committed by the next ``save``,
        ``wait_for_save`` or ``close`` (``tessera.launcher.checkpoint.saving``)."""
        self.wait_for_save()
        self._check_finite(f"saving to {path}")
        done = save_engine(self, self.step, path, keep_last=keep_last, background=background)
        if isinstance(done, Path):
            return done
        self._pending_save = done
        return done.generation

    def checkpoint_storage(self, root: str | Path) -> Storage:
        """Which ranks share the checkpoint folder ``root`` (``tessera.launcher.checkpoint.storage``);
        found out at the first save or load under it (collective then), and logged."""
        key = Path(root)
        if key not in self._storage:
            self._storage[key] = probe_storage(key, self.mesh.device)
        return self._storage[key]

    def wait_for_save(self) -> Path | None:
        """Wait for the save pending in the background and commit it; its directory (None if
        none was pending). Collective; a failed background write raises here on every rank,
        naming the file."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.finish()

    def load(self, path: str | Path) -> Path:
        """Resume from the newest committed generation under ``path`` (or the generation
        ``path``) at the same topology and configuration; returns it. Collective; a pending
        background save is committed first."""
        self.wait_for_save()
        self.step, generation = load_engine(self, path)
        if self.verifier is not None:
            self.verifier.weights_replaced()
        return generation

    def _check_finite(self, what: str) -> None:
        bad = [i for i, flat in enumerate(self.zero.flats) if not bool(torch.isfinite(flat.master).all())]
        error = None
        if bad:
            names = [n for i in bad for n in self.zero.flats[i].names][:5]
            error = ValueError(f"{what}: non-finite weights in {names}; nothing written")
        raise_together(error, None, what, self.mesh.device)

    def full_state_dict(self) -> dict[str, Tensor]:
        """This rank's pipeline stages as full fp32 serial tensors by serial name (collective
        over tp and dp; with pp > 1 each pipeline rank gets only its stages' parameters)."""
        return local_full_parameters(self)

    def import_weights(self, path: str | Path, extra: Mapping[str, Tensor] | None = None) -> None:
        """Load the serial model's weights by parameter name (for the Hugging Face plans, HF
        names) from a safetensors file (what ``consolidate`` writes) or a folder of shards with
        its ``model.safetensors.index.json`` (what ``export`` writes), one tensor at a time,
        into every rank's shards under any topology; the optimizer state starts fresh. An
        adapted layer's base is read under the plain model's name (a pretrained checkpoint);
        ``extra``: full values of parameters the file lacks (new adapters) by serial name.
        Collective (every rank agrees the file is valid before any changes)."""
        error = None
        try:
            import_weights(self, Path(path), extra)
        except (OSError, ValueError, KeyError) as e:
            error = e
        raise_together(error, None, f"importing {path}", self.mesh.device)
        if self.verifier is not None:
            self.verifier.weights_replaced()

    def import_dcp(self, path: str | Path, *, prefix: str | None = None) -> None:
        """Load the model's weights from a ``torch.distributed.checkpoint`` folder (FSDP2's
        ``dcp.save({"model": get_model_state_dict(model)})``, torchtitan's bare names), each rank
        reading its parameters' full values one at a time, into its shards under any topology;
        the optimizer state starts fresh. ``prefix``: where the names are (found when None).
        Collective; a missing, foreign or misshapen name raises on every rank before anything
        changes (``checkpoint.dcp``)."""
        import_dcp(self, path, prefix=prefix)
        if self.verifier is not None:
            self.verifier.weights_replaced()

    def export_dcp(
        self, path: str | Path, *, prefix: str = "model", dtype: torch.dtype = torch.float32
    ) -> Path:
        """Write the serial model as a ``torch.distributed.checkpoint`` folder that FSDP2 loads
        (``dcp.load({"model": get_model_state_dict(fsdp_model)}, ...)``; ``prefix=""``: bare names,
        as torchtitan loads), streamed past a staging folder beside it; collective; returns it."""
        return export_dcp(self, path, prefix=prefix, dtype=dtype)

    def consolidate(self, path: str | Path) -> dict[str, Tensor] | None:
        """Write the serial model's state dict to ``path``; rank 0 also returns it (collective)."""
        return consolidate(self, path)

    def export(
        self,
        directory: str | Path,
        *,
        max_shard_bytes: int = MAX_SHARD_BYTES,
        dtype: torch.dtype = torch.float32,
    ) -> Path:
        """Write the serial model to ``directory`` as a sharded Hugging Face checkpoint (shards
        of at most ``max_shard_bytes``, each written by one rank as the parameters stream past
        one ZeRO flat buffer at a time, and the index), the fp32 masters rounded to ``dtype``;
        collective; returns the index's path (``consolidate.export_sharded``)."""
        return export_sharded(self, directory, max_shard_bytes=max_shard_bytes, dtype=dtype)

    def save_adapter(self, directory: str | Path) -> Path:
        """Write the adapters of a model boosted from ``peft.get_peft_model(...)`` in PEFT's format
        (``adapter_config.json``, ``adapter_model.safetensors``), loadable by
        ``PeftModel.from_pretrained``; collective, rank 0 writes (``checkpoint.adapter_files``)."""
        return save_adapter(self, directory)

    def export_merged(
        self,
        directory: str | Path,
        *,
        max_shard_bytes: int = MAX_SHARD_BYTES,
        dtype: torch.dtype = torch.float32,
    ) -> Path:
        """``export`` with every adapter merged into its base layer's weight, under the plain
        model's names (``q_proj.weight``): what ``transformers`` loads without PEFT; collective."""
        return export_merged(self, directory, max_shard_bytes=max_shard_bytes, dtype=dtype)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_loss(self, inputs: Inputs | None, targets: Tensor | None, *, local: bool = False) -> float:
        """The mean loss on the global batch (``local``: this rank's rows, as in
        ``train_step``), without updating anything; collective."""
        self.module.eval()
        x, y = self._local_batch(inputs, targets, local, parts=1)
        with self.zero.gathered():
            if self.runtime is None:
                assert x is not None and y is not None  # batch_needs: both without a pipeline
                mean = float(self._forward_loss(x, y))
            else:
                stages, owners, device = self.runtime.stages, self.placement.stage_to_rank, self.mesh.device
                assert not isinstance(x, Mapping)
                mean = forward_loss(stages, owners, x, y, self.step_loss, group=self.pp, device=device)
        out = all_reduce(torch.tensor([mean], dtype=torch.float64, device=self.mesh.device), self.dp, "avg")
        return float(out[0])

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Commit a save pending in the background (``wait_for_save``), then release what
        ``boost`` created: the optimizer's chunk manager (thread, hooks, disk directory) and
        every process group of the mesh. The default group stays (it is the caller's); the
        engine is unusable afterwards. Closing twice is harmless."""
        try:
            self.wait_for_save()
        finally:
            self.zero.close()
            self.mesh.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parts(t: Tensor | None, parts: int) -> list[Tensor | None]:
    """``t``'s ``parts`` row chunks in order (as many Nones without ``t``)."""
    return [None] * parts if t is None else list(torch.tensor_split(t, parts))


def _joined(shares: list[Tensor | None]) -> Tensor | None:
    """The row chunks joined again (None when there were none)."""
    kept = [t for t in shares if t is not None]
    return torch.cat(kept) if kept else None
