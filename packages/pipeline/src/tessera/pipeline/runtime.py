"""The pipeline runtime: execute this rank's part of any valid `Schedule` over tessera.comm p2p.

Every rank of the pipeline group builds a `PipelineRuntime` with the same schedule and its
own virtual stages, then calls `PipelineRuntime.step` once per batch. A step:

1. splits the batch into ``m`` equal microbatches (the first stage reads ``inputs``, the last
   ``targets``; other ranks pass nothing);
2. runs this rank's actions in order. F runs the stage; on the last stage it also computes
   ``loss_fn(output, targets_mb)``. BW is one full backward. B computes only the input
   gradient and W the weight gradients later (`tessera.pipeline.split_backward`); a W that
   directly follows its own B with nothing sent in between is merged into one full backward
   (`fuse_adjacent`), and an `nn.Sequential` first stage keeps its first block (the
   embedding) out of B so that its B and W cost what the schedule assumes
   (`PipelineRuntime._first_forward`).
   Sends are non-blocking and awaited at the end of the step; a receive is waited for right
   before the compute that needs it (the schedule places it there), as `validate` assumes.
   Activation shapes are agreed once per step by a header (`tessera.pipeline.channels`);
3. leaves the gradients accumulated in each parameter's ``.grad``.

**Equal to the serial model.** The backward of microbatch ``i`` starts from
``loss_i / m``, so the accumulated gradients are those of the mean of the microbatch losses,
which for equal microbatches and a mean-reduced loss (cross-entropy over tokens) is the loss
of the whole batch: ``GPT.loss(idx, targets)`` of the serial model, to fp32 round-off.
Gradients add to whatever ``.grad`` holds (zero them between steps, as with ``backward``).

**Errors.** An exception on any rank is published to the other ranks through the c10d store;
each of them raises `PipelineAborted` naming the rank and the error instead of hanging (in
the same step, or in the next if it had already finished that one). A step that was aborted
may leave unmatched messages in flight, so the runtime refuses further steps: end the job
(the launcher does) or build a new process group.

Times in `StepResult` are ``time.perf_counter()`` seconds; on an accelerator they measure the
host side (kernel launches), not the device.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

from tessera.comm import (
    Group,
    batch_isend_irecv,
    broadcast,
    default_device,
    group_rank,
    group_size,
    share_memory,
)
from tessera.pipeline.actions import Action, ActionKind, Schedule
from tessera.pipeline.channels import Inbox, Message, PipelineAborted, Transfer, Watch, encode_header
from tessera.pipeline.merge import fuse_adjacent
from tessera.pipeline.microbatch import split_microbatches
from tessera.pipeline.partition import Partition
from tessera.pipeline.simulate import TimedAction
from tessera.pipeline.split_backward import WeightGrad, backward_full, backward_input, grad_nodes
from tessera.pipeline.tune import SplitTuner
from tessera.pipeline.validate import validate

__all__ = ["LossFn", "PipelineAborted", "PipelineRuntime", "StepResult", "stage_modules"]

logger = logging.getLogger(__name__)

K = ActionKind
LossFn = Callable[[Tensor, Tensor], Tensor]
_Key = tuple[int, int]  # (microbatch, stage)


def _peer(a: Action) -> int:
    assert a.peer is not None, f"{a} is a p2p action without a peer"
    return a.peer


def stage_modules(blocks: Sequence[nn.Module], partition: Partition, rank: int) -> dict[int, nn.Module]:
    """This rank's virtual stages: ``{stage: nn.Sequential(blocks of the stage)}``."""
    if len(blocks) != partition.num_blocks:
        raise ValueError(f"{len(blocks)} blocks for a partition of {partition.num_blocks}")
    return {
        s: nn.Sequential(*(blocks[b] for b in partition.blocks_of_stage(s)))
        for s in partition.stages_of_rank(rank)
    }


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one `PipelineRuntime.step` did on this rank.

    ``losses``: the (unscaled) loss of every microbatch, on the rank holding the last stage
    (empty elsewhere); ``loss``: their mean (the serial batch loss), on that rank or, with
    ``broadcast_loss=True``, on every rank. ``timeline``: this rank's compute actions with
    start and end times, as they ran (a B whose W directly follows it ran one full backward:
    it shows as a BW, and the W not at all; `fit_costs` reads timelines);
    ``started``/``finished``: the step's own start and end.
    """

    losses: tuple[float, ...]
    loss: float | None
    timeline: tuple[TimedAction, ...]
    started: float
    finished: float

    @property
    def busy(self) -> float:
        """Seconds this rank spent computing (sum of its compute actions)."""
        return math.fsum(t.end - t.start for t in self.timeline)


class PipelineRuntime:
    """Executes this rank's actions of ``schedule`` on its ``stages`` (see the module docstring).

    ``stages`` maps every virtual stage the schedule places on this rank (its rank inside
    ``group``) to its module; each takes and returns one tensor, and activations between
    stages are floating point. ``loss_fn(output, targets)`` of the last stage returns a
    scalar, mean-reduced over the microbatch. Construction does not communicate, but every
    rank must build the runtimes of a group in the same order (their abort keys are counted).
    ``tune_splits`` > 0 with a split-backward schedule: its first steps time the schedule
    split and unsplit in ``tune_splits`` pairs of steps after a warm-up, then `merge_splits`
    under the costs measured against the better of the two, and it keeps the faster
    (`tessera.pipeline.tune`; ``split_tuning`` holds the finished `SplitTuner`: costs, step
    times, the form kept).
    Every rank of ``tune_group`` (default: the whole job) decides together, at the same
    steps: a job of several pipelines whose ranks meet in other collectives
    (tensor-parallel peers of a stage) must run one order.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        loss_fn: LossFn,
        *,
        group: Group = None,
        device: torch.device | None = None,
        timeout_s: float = 1800.0,
        tune_splits: int = 0,
        tune_group: Group = None,
    ) -> None:
        validate(schedule)
        self.schedule = schedule
        self.group = group
        self.rank = group_rank(group)
        if group_size(group) != schedule.num_ranks:
            raise ValueError(
                f"{schedule.name} has {schedule.num_ranks} ranks but the group has {group_size(group)}"
            )
        mine = schedule.stages_of(self.rank)
        if sorted(stages) != list(mine):
            raise ValueError(
                f"rank {self.rank} holds stages {list(mine)} of {schedule.name}; got modules for "
                f"{sorted(stages)}"
            )
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        self.params: dict[int, list[Tensor]] = {
            s: [p for p in m.parameters() if p.requires_grad] for s, m in self.stages.items()
        }
        first = next((p for ps in self.params.values() for p in ps), None)
        self.device = device or (first.device if first is not None else default_device())
        self.watch = Watch(group, timeout_s, self.device)
        if self.device.type == "cpu" and group_size(group) > 1:
            share_memory(group)  # collective: messages between ranks of one host use shared memory
        self._nodes: dict[int, list[Node]] = {}
        self._adopt(schedule)
        self._tuner = SplitTuner(schedule, tune_splits) if tune_splits and schedule.split_backward else None
        self._tune_group = tune_group
        self.split_tuning: SplitTuner | None = None  # the tuner, once it has chosen
        self._broken: str | None = None
        self._body: tuple[nn.Module, list[Tensor], list[Node]] | None = None
        self._reset()

    # ------------------------------------------------------------------ setup
    def _adopt(self, schedule: Schedule) -> None:
        """Take ``schedule``'s order of actions and messages (for the next step on)."""
        self.schedule = schedule
        self._seed = 1.0 / schedule.num_microbatches  # d(step loss)/d(microbatch loss), times the loss scale
        if schedule.split_backward and not self._nodes:
            self._nodes = {s: grad_nodes(ps) for s, ps in self.params.items()}
        self.last = schedule.num_stages - 1
        running = fuse_adjacent(schedule)  # a B its W directly follows runs as one BW
        self.actions = running.actions[self.rank]
        # units whose W really runs apart from their B (a schedule may mix them with BW units)
        self._deferred = running.split_units()
        logger.debug(
            "rank %d: %s, B+W fused for %s",
            self.rank,
            schedule.name,
            sorted(schedule.split_units() - self._deferred),
        )
        self.inboxes = {
            peer: Inbox(peer, order, self.group, self.device, self.watch, self._grad_meta)
            for peer, order in self._incoming().items()
        }

    def reschedule(self, schedule: Schedule) -> None:
        """Run the next steps by ``schedule``: the same stages on the same ranks and the same
        number of microbatches, in another order (e.g. `merge_splits` of the current one).
        Between steps, on every rank of the group; ValueError naming what differs."""
        validate(schedule)
        old = self.schedule
        for what in ("num_ranks", "num_microbatches", "stage_to_rank"):
            if getattr(schedule, what) != getattr(old, what):
                raise ValueError(
                    f"reschedule: {schedule.name} has {what}={getattr(schedule, what)}, the runtime's "
                    f"{old.name} {getattr(old, what)}"
                )
        self._adopt(schedule)
        self._reset()

    def _incoming(self) -> dict[int, list[Message]]:
        """Per peer, the messages it sends this rank in its own order, headers included."""
        incoming: dict[int, list[Message]] = {}
        for peer, acts in enumerate(self.schedule.actions):
            headed: set[int] = set()
            for a in acts:
                if a.kind not in (K.SEND_F, K.SEND_B) or a.peer != self.rank:
                    continue
                order = incoming.setdefault(peer, [])
                if a.kind is K.SEND_F and a.stage not in headed:
                    headed.add(a.stage)
                    order.append(("H", 0, a.stage))
                order.append(a.message)
        return incoming

    def _reset(self) -> None:
        self._inputs: dict[_Key, Tensor] = {}  # stage input (a leaf) per (microbatch, stage)
        self._outputs: dict[_Key, Tensor] = {}  # stage output, or the last stage's loss
        self._grads: dict[_Key, Tensor] = {}  # gradient of a stage's output
        self._input_grads: dict[_Key, Tensor] = {}  # gradient of a stage's input, to send
        # per (microbatch, stage) after B: the deferred W, and stage 0's first-block output and
        # its gradient (see _first_forward)
        self._weight_grads: dict[_Key, tuple[WeightGrad, Tensor | None, Tensor | None]] = {}
        self._entries: dict[int, Tensor] = {}  # stage 0's first-block output per microbatch
        self._losses: dict[int, Tensor] = {}
        self._sends: list[Transfer] = []
        self._headed: set[int] = set()
        self._timeline: list[TimedAction] = []
        self._mb_inputs: list[Tensor] = []
        self._mb_targets: list[Tensor] = []
        for inbox in self.inboxes.values():
            inbox.reset()

    def _grad_meta(self, mb: int, stage: int) -> tuple[tuple[int, ...], torch.dtype] | None:
        out = self._outputs.get((mb, stage))
        return None if out is None else (tuple(out.shape), out.dtype)

    # ------------------------------------------------------------------ step
    def step(
        self,
        inputs: Tensor | None = None,
        targets: Tensor | None = None,
        *,
        broadcast_loss: bool = False,
        loss_scale: float = 1.0,
    ) -> StepResult:
        """Run one forward/backward of the batch over the pipeline (collective over the group).

        ``inputs`` (batch first) is needed on the rank of stage 0, ``targets`` on the rank of
        the last stage; the batch must split into ``schedule.num_microbatches`` equal parts.
        ``loss_scale``: backward starts from ``loss_scale * loss_i / m`` (fp16 loss scaling;
        the losses reported stay unscaled).
        """
        if self._broken is not None:
            raise RuntimeError(
                f"pipeline step {self._broken} was aborted and may have left messages in flight; "
                "build a new process group (and runtime) before stepping again"
            )
        if self._tuner is not None:  # may reschedule; the step after the last measured one gathers
            planned = self._tuner.next_schedule(self._tune_group)
            if planned is not self.schedule:
                self.reschedule(planned)
            if self._tuner.done:
                self.split_tuning, self._tuner = self._tuner, None
        self.watch.step += 1
        self._seed = loss_scale / self.schedule.num_microbatches
        started = time.perf_counter()
        try:
            self._split_batch(inputs, targets)
            for inbox in self.inboxes.values():
                inbox.prefetch()
            for action in self.actions:
                self._run(action)
            for i, sent in enumerate(self._sends):
                self.watch.wait(sent, f"send {i} of {len(self._sends)}")
            for inbox in self.inboxes.values():
                inbox.check_done()
            losses = (
                tuple(torch.stack([self._losses[i] for i in sorted(self._losses)]).tolist())
                if self._losses
                else ()
            )
        except BaseException as exc:
            self._broken = str(self.watch.step)
            if not isinstance(exc, PipelineAborted):
                self.watch.signal(exc)
            raise
        finally:
            timeline = tuple(self._timeline)
            self._reset()
        if self._tuner is not None:
            self._tuner.record(timeline, time.perf_counter() - started)
        loss = math.fsum(losses) / len(losses) if losses else None
        if broadcast_loss:
            owner = self.schedule.stage_to_rank[self.last]
            value = torch.tensor([loss or 0.0], dtype=torch.float64, device=self.device)
            loss = float(broadcast(value, owner, self.group).item())
        return StepResult(losses, loss, timeline, started, time.perf_counter())

    def _split_batch(self, inputs: Tensor | None, targets: Tensor | None) -> None:
        m = self.schedule.num_microbatches
        for stage, name, batch, out in (
            (0, "inputs", inputs, self._mb_inputs),
            (self.last, "targets", targets, self._mb_targets),
        ):
            if stage not in self.stages:
                continue
            if batch is None:
                raise ValueError(f"rank {self.rank} holds stage {stage} and needs {name}")
            out.extend(split_microbatches(batch.to(self.device), m, name))

    def _run(self, a: Action) -> None:
        kind, key = a.kind, (a.microbatch, a.stage)
        if kind is K.RECV_F:
            x = self.inboxes[_peer(a)].get(a.message)
            self._inputs[key] = x.requires_grad_()
        elif kind is K.RECV_B:
            self._grads[key] = self.inboxes[_peer(a)].get(a.message)
        elif kind is K.SEND_F:
            out = self._outputs[key].detach()
            if a.stage not in self._headed:
                self._headed.add(a.stage)
                self._send(encode_header(out), a)
            self._send(out, a)
        elif kind is K.SEND_B:
            self._send(self._input_grads.pop(key), a)
        else:
            start = time.perf_counter()
            {K.F: self._forward, K.BW: self._backward, K.B: self._backward, K.W: self._weights}[kind](a)
            self._timeline.append(TimedAction(self.rank, a, start, time.perf_counter()))
            for inbox in self.inboxes.values():
                inbox.prefetch()

    def _send(self, tensor: Tensor, a: Action) -> None:
        pending = []
        for sent in self._sends:  # let finished sends go (wait() raises their errors)
            if sent.is_completed():
                sent.wait()
            else:
                pending.append(sent)
        pending.append(batch_isend_irecv([(tensor, _peer(a))], [], self.group))
        self._sends = pending

    def _forward(self, a: Action) -> None:
        mb, s = a.microbatch, a.stage
        y = self._first_forward(mb) if s == 0 else self.stages[s](self._inputs[(mb, s)])
        if not isinstance(y, Tensor):
            raise TypeError(f"stage {s} returned {type(y).__name__}; stages must return one tensor")
        if s == self.last:
            loss = self.loss_fn(y, self._mb_targets[mb])
            self._losses[mb] = loss.detach()
            self._outputs[(mb, s)] = loss
            self._grads[(mb, s)] = torch.full_like(loss, self._seed)
        else:
            self._outputs[(mb, s)] = y
            if s + 1 in self.stages:  # the next stage is local: hand over without p2p
                self._inputs[(mb, s + 1)] = y.detach().requires_grad_()

    def _first_forward(self, mb: int) -> Tensor:
        """Stage 0. With a split backward, an `nn.Sequential` stage runs its first block apart.

        The first stage has no input gradient to compute, so its B would be empty and its W
        the whole backward, unlike the cost model the zero-bubble schedules are built on.
        Cutting the autograd graph after the first block (the embedding) gives B the
        activation gradients of the other blocks, and W their weight gradients plus the first
        block's backward: the same gradients, with the work where the schedule expects it.
        """
        x, module = self._mb_inputs[mb], self.stages[0]
        split = (mb, 0) in self._deferred  # a BW (a fused B and W too) runs unsplit
        if not (split and isinstance(module, nn.Sequential) and len(module) > 1):
            out: Tensor = module(x)
            return out
        entry = module[0](x)
        if not (isinstance(entry, Tensor) and entry.is_floating_point()):
            out = module[1:](entry)
            return out
        h = entry.detach().requires_grad_()
        self._inputs[(mb, 0)] = h
        self._entries[mb] = entry
        out = module[1:](h)
        return out

    def _backward(self, a: Action) -> None:
        """BW (full backward) or B (input gradient, W deferred)."""
        key = (a.microbatch, a.stage)
        out, grad = self._outputs.pop(key), self._grads.pop(key)
        x = self._inputs.pop(key, None)
        params, nodes = self.params[a.stage], self._nodes.get(a.stage)
        entry = self._entries.pop(a.microbatch, None) if a.stage == 0 else None
        if entry is not None:  # B and W of stage 0 leave out its first block
            params, nodes = self._body_params()
        if a.kind is K.BW:
            backward_full(out, grad)
            dx = x.grad if x is not None else None
        else:
            dx, weights = backward_input(out, grad, x, params, nodes)
            self._weight_grads[key] = (weights, entry, dx)
        if a.stage == 0:
            return
        if dx is None:
            raise RuntimeError(f"stage {a.stage} microbatch {a.microbatch}: its input got no gradient")
        if a.stage - 1 in self.stages:
            self._grads[(a.microbatch, a.stage - 1)] = dx
        else:
            self._input_grads[key] = dx

    def _body_params(self) -> tuple[list[Tensor], list[Node]]:
        """Stage 0's parameters after its first block, and their gradient nodes (cached)."""
        first = self.stages[0]
        assert isinstance(first, nn.Sequential)
        if self._body is None or self._body[0] is not first:
            params: list[Tensor] = [p for p in first[1:].parameters() if p.requires_grad]
            self._body = (first, params, grad_nodes(params))
        return self._body[1], self._body[2]

    def _weights(self, a: Action) -> None:
        weights, entry, d_entry = self._weight_grads.pop((a.microbatch, a.stage))
        weights.run()
        if entry is not None and entry.requires_grad:  # stage 0's first block (see _first_forward)
            torch.autograd.backward(entry, d_entry)
