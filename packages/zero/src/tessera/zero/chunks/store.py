"""``ChunkStore``: the chunks of every FlatParam shard of this rank, placed on tiers and moved.

Built by ``ZeroOptimizer(memory=ChunkConfig(...))`` from the FlatParams' layouts; ``take``
then hands it each FlatParam once filled. It takes over, from each FlatParam, the
fp32 master (and, at stage 3 in fp32, where the master *is* the parameter shard, the shard
itself: the stage-3 gather reads it from the chunks), the reduced gradient (handed over as
each reduction finishes during backward) and the optimizer state, cut into chunks
(``tessera.zero.chunks.chunk``) and placed on the device, the host or the disk
(``tessera.zero.chunks.policy``). The optimizer steps chunk by chunk (``step.py``).

Frozen FlatParams (parameters without gradients) keep only their compute-dtype values, and
their master is their shard. At stage 3 the store owns that shard, as it owns an fp32 one:
their *frozen chunks* hold it in the compute dtype (counted at its size in the budgets),
are placed and prefetched like the others and refill the shard for each gather, but are
never given a gradient, stepped or written back (on disk: written when placed, moved or
loaded from a checkpoint, only read by training). At stages 0-2 every rank keeps the full
compute-dtype parameters for compute anyway and a frozen shard is a view of them, so the
store holds nothing of a frozen FlatParam (``holds``): its checkpoints and portable state
read and write that shard directly.

Order: the chunks are used, placed, stepped and prefetched in the order the warm-up step
(the first one) first touched them (the stage-3 gathers of forward, then gradients as
backward produces them); before that, in chunk order.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from tessera.zero.chunks.chunk import Chunk, ChunkState, Tier, plan_chunks
from tessera.zero.chunks.config import MIB, ChunkConfig
from tessera.zero.chunks.early import EarlySteps
from tessera.zero.chunks.policy import capacities, place
from tessera.zero.chunks.probe import probe_state_streams
from tessera.zero.chunks.tiers import DiskTier
from tessera.zero.chunks.tracer import MemoryTracer
from tessera.zero.flat_param import FlatParam
from tessera.zero.offload import HOST, host_empty

__all__ = ["ChunkStore"]

log = logging.getLogger(__name__)
Pieces = list[tuple[int, int, float]] | None


class ChunkStore:
    """Chunks of this rank's FlatParam shards on the device, host and disk tiers, under budgets."""

    def __init__(
        self,
        model: nn.Module,
        flats: Sequence[FlatParam],
        optimizer: torch.optim.Optimizer,
        config: ChunkConfig,
        *,
        stage3: bool,
        weights: Sequence[Pieces] | None = None,
        label: str = "rank0",
    ) -> None:
        self.flats = list(flats)
        self.optimizer = optimizer
        self.config = config
        self.device = self.flats[0].device
        # the FlatParams whose shard the store owns: stage 3 where the master is the shard
        self._owns = [stage3 and (f.frozen or f.compute_dtype == torch.float32) for f in self.flats]
        self._holds = [o or not f.frozen for o, f in zip(self._owns, self.flats, strict=True)]
        self._weights = list(weights) if weights is not None else [None] * len(self.flats)
        self._pin = torch.accelerator.is_available()
        self.state_names = probe_state_streams(optimizer)
        self.elem_bytes = 4 * (2 + len(self.state_names))  # master + gradient + state, fp32
        largest = max(f.layout.shard_numel for f in self.flats)
        self.chunk_numel = config.numel_for(largest, self.elem_bytes)
        self.disk = DiskTier(config.disk_dir, label=label) if config.disk_dir is not None else None
        self._closer = weakref.finalize(self, _close, self.disk)
        self.chunks: list[Chunk] = []
        self._by_flat: list[list[Chunk]] = [[] for _ in self.flats]
        numels = [
            f.layout.shard_numel if held else 0 for f, held in zip(self.flats, self._holds, strict=True)
        ]
        for fi, lo, hi in plan_chunks(numels, self.chunk_numel):
            flat = self.flats[fi]
            placeholder = nn.Parameter(torch.empty(0, device=self.device), requires_grad=False)
            chunk = Chunk(len(self.chunks), fi, flat.group_index, lo, hi, Tier.HOST, placeholder)
            if flat.frozen:
                chunk.frozen, chunk.dtype = True, flat.compute_dtype
            self.chunks.append(chunk)
            self._by_flat[fi].append(chunk)
        self.order: list[Chunk] = list(self.chunks)
        self._recorded: list[Chunk] = []
        self._seen: set[int] = set()
        self.warm = False  # whether the warm-up step is done
        self._grad_sq: dict[int, tuple[float, bool]] = {}
        self.reserved = (0, 0)  # measured non-model memory (host, device)
        self._tracer = MemoryTracer(self.device)
        self._hook = model.register_forward_pre_hook(self._on_forward, prepend=True)  # before stage 3 gathers
        self._pool: ThreadPoolExecutor | None = None
        self.early: EarlySteps | None = None  # step_in_backward
        tiers = self._placement(slowest_first=config.policy == "auto")
        for chunk, tier in zip(self.chunks, tiers, strict=True):
            chunk.tier = tier
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = [c.param for c in self.chunks if c.group_index == gi]
        optimizer.state.clear()

    def owns(self, flat_index: int) -> bool:
        """Whether the store owns the FlatParam's parameter shard (stage 3, where its master is
        its shard: in fp32, or frozen): gathers refill it from the chunks."""
        return self._owns[flat_index]

    def holds(self, flat_index: int) -> bool:
        """Whether the FlatParam's values live in chunks: every one but a frozen FlatParam at
        stages 0-2, whose values are its shard, a view of the full parameters (module docstring)."""
        return self._holds[flat_index]

    def chunk_bytes(self, chunk: Chunk) -> int:
        """The bytes a chunk holds at most: every stream (master, gradient, optimizer state) in
        fp32; a frozen chunk's one stream in its compute dtype."""
        return chunk.numel * (chunk.dtype.itemsize if chunk.frozen else self.elem_bytes)

    def take(self, flat_index: int) -> None:
        """Copy filled FlatParam ``flat_index``'s master into its chunks, on their tiers (then
        ``ChunkedFlatParam.attach`` releases the FlatParam's own copy): one FlatParam at a
        time, in any order (a frozen FlatParam's values in its compute dtype)."""
        flat = self.flats[flat_index]
        for chunk in self._by_flat[flat_index]:
            source = flat.master.detach()[chunk.lo : chunk.hi]
            self._put(
                chunk,
                "master",
                source if chunk.tier is Tier.DISK else self.copy_to(source, chunk.tier, chunk.dtype),
            )

    # ------------------------------------------------------------------ placement
    @property
    def has_device_tier(self) -> bool:
        """Whether chunks may live on an accelerator (a device budget on a non-CPU device)."""
        return self.device.type != "cpu" and self.config.device_budget_mb is not None

    @property
    def staging_bytes(self) -> int:
        """Host bytes disk chunks pass through: the one in use and the one prefetched."""
        return (2 if self.config.prefetch else 1) * self.chunk_numel * self.elem_bytes

    @property
    def scratch_bytes(self) -> int:
        """Room for the optimizer's temporaries while it steps one chunk (Adam: its denominator)."""
        return self.chunk_numel * self.elem_bytes

    def _placement(self, *, slowest_first: bool = False) -> list[Tier]:
        caps = capacities(
            device_budget=self.config.budget_bytes("device") if self.has_device_tier else None,
            host_budget=self.config.budget_bytes("host"),
            disk=self.disk is not None,
            staging=self.staging_bytes,
            scratch=self.scratch_bytes,
            reserve_host=self.reserved[0],
            reserve_device=self.reserved[1],
        )
        in_order = place(
            [self.chunk_bytes(c) for c in self.order],
            caps,
            fractions=self.config.fractions,
            slowest_first=slowest_first,
        )
        by_chunk = {c.index: t for c, t in zip(self.order, in_order, strict=True)}
        return [by_chunk[c.index] for c in self.chunks]

    def report(self) -> dict[str, Any]:
        """Bytes and chunks per tier (``chunk_bytes``; ``frozen``: the frozen chunks' among
        them), the chunk size, staging, measured non-model memory and disk traffic so far."""
        out: dict[str, Any] = {
            "chunk_numel": self.chunk_numel,
            "chunks": len(self.chunks),
            "bytes_per_element": self.elem_bytes,
            "staging_bytes": self.staging_bytes,
            "scratch_bytes": self.scratch_bytes,
            "non_model_bytes": {"host": self.reserved[0], "device": self.reserved[1]},
            "disk_read": 0 if self.disk is None else self.disk.bytes_read,
            "disk_written": 0 if self.disk is None else self.disk.bytes_written,
            "disk_dir": None if self.disk is None else str(self.disk.dir),
        }
        for tier in Tier:
            mine = [c for c in self.chunks if c.tier is tier]
            out[tier.value] = {"chunks": len(mine), "bytes": sum(self.chunk_bytes(c) for c in mine)}
        frozen = [c for c in self.chunks if c.frozen]
        out["frozen"] = {"chunks": len(frozen), "bytes": sum(self.chunk_bytes(c) for c in frozen)}
        out["placement"] = [c.tier.value for c in self.chunks]
        out["resident_bytes"] = self.resident_bytes()
        return out

    def chunks_of(self, flat_index: int) -> list[Chunk]:
        """The chunks of FlatParam ``flat_index``, in order of their element ranges."""
        return self._by_flat[flat_index]

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of chunk streams held in memory right now, by tier (a budget counts every
        stream a chunk will hold; before the first step there is no optimizer state yet)."""
        held = dict.fromkeys((t.value for t in Tier), 0)
        for c in self.chunks:
            held[c.tier.value] += sum(t.numel() * t.element_size() for t in c.streams.values())
        return held

    def log_report(self, when: str) -> None:
        """Log how much of each tier the chunks need and where each one went."""
        r = self.report()
        log.info(
            "chunk manager %s (%s): %d chunks of %d elements x %d bytes (master, gradient, %s), "
            "%d of them frozen (%.2f MiB, the compute dtype only); "
            "device %.2f MiB in %d, host %.2f MiB in %d (+%.2f MiB staging, +%.2f MiB scratch), "
            "disk %.2f MiB in %d%s; "
            "non-model memory measured: host %.2f MiB, device %.2f MiB",
            when,
            self.config.policy,
            r["chunks"],
            self.chunk_numel,
            self.elem_bytes,
            ", ".join(self.state_names),
            r["frozen"]["chunks"],
            r["frozen"]["bytes"] / MIB,
            r["device"]["bytes"] / MIB,
            r["device"]["chunks"],
            r["host"]["bytes"] / MIB,
            r["host"]["chunks"],
            self.staging_bytes / MIB,
            self.scratch_bytes / MIB,
            r["disk"]["bytes"] / MIB,
            r["disk"]["chunks"],
            f" under {r['disk_dir']}" if r["disk_dir"] else "",
            self.reserved[0] / MIB,
            self.reserved[1] / MIB,
        )
        for c in self.chunks:
            log.debug("chunk %d: %s %s", c.index, self.flats[c.flat_index].names[:3], c.tier.value)

    def relocate(self, tiers: Sequence[Tier]) -> int:
        """Move every chunk whose tier changes to ``tiers[i]``; returns how many moved."""
        moved = 0
        for chunk, tier in zip(self.chunks, tiers, strict=True):
            if chunk.tier is tier:
                continue
            loaded = self.load(chunk, self.present(chunk))
            self._clear(chunk)
            chunk.tier = tier
            for name, tensor in loaded.items():
                self._put(chunk, name, tensor)
            moved += 1
        return moved

    # ------------------------------------------------------------------ warm-up
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not self.warm and not self._tracer.running:
            self._tracer.start()

    def touch(self, chunk: Chunk) -> None:
        """Record a use of ``chunk`` (the warm-up step records the order of first uses)."""
        if not self.warm and chunk.index not in self._seen:
            self._seen.add(chunk.index)
            self._recorded.append(chunk)

    def touch_flat(self, flat_index: int) -> None:
        """Record a use of every chunk of a FlatParam (its stage-3 gather is being waited for)."""
        for chunk in self._by_flat[flat_index]:
            self.touch(chunk)

    def end_warmup(self) -> None:
        """At the first step: adopt the recorded order and, under ``auto``, the measured
        non-model memory, and place the chunks again by them (once)."""
        if self.warm:
            return
        self.warm = True
        self.order = self._recorded + [c for c in self.chunks if c.index not in self._seen]
        if self._tracer.running:
            host, device = self._tracer.stop()
            grads = {
                t: sum(c.numel * 4 for c in self.chunks if c.tier is t and "grad" in c.streams) for t in Tier
            }
            self.reserved = (max(0, host - grads[Tier.HOST]), max(0, device - grads[Tier.DEVICE]))
        if self.config.policy == "auto":
            moved = self.relocate(self._placement())
            self.log_report(f"re-placed after the warm-up step ({moved} chunks moved)")
        else:
            self.log_report("warm-up measured")

    # ------------------------------------------------------------------ streams
    def _tier_device(self, tier: Tier) -> torch.device:
        return self.device if tier is Tier.DEVICE else HOST

    def copy_to(self, tensor: Tensor, tier: Tier, dtype: torch.dtype = torch.float32) -> Tensor:
        """A new copy of ``tensor`` in ``dtype`` where ``tier`` keeps it in memory (the device,
        or host memory: pinned where an accelerator exists; a disk chunk's staging)."""
        if tier is Tier.DEVICE:
            return tensor.to(self.device, dtype, copy=True)
        out = host_empty(tensor.numel(), dtype)
        out.copy_(tensor)
        return out

    def _put(self, chunk: Chunk, name: str, tensor: Tensor) -> None:
        """Store a copy of ``tensor`` as the chunk's stream ``name`` on its tier, in its dtype."""
        if chunk.tier is Tier.DISK:
            assert self.disk is not None
            self.disk.write(chunk.index, name, tensor.to("cpu", chunk.dtype))
            chunk.on_disk.add(name)
        else:
            same = tensor.device == self._tier_device(chunk.tier) and tensor.dtype == chunk.dtype
            chunk.streams[name] = (
                tensor if same and tensor.is_contiguous() else self.copy_to(tensor, chunk.tier, chunk.dtype)
            )

    def _clear(self, chunk: Chunk) -> None:
        for name in list(chunk.on_disk):
            assert self.disk is not None
            self.disk.drop(chunk.index, name)
        chunk.on_disk.clear()
        chunk.streams.clear()

    def present(self, chunk: Chunk) -> list[str]:
        """The streams the chunk holds now."""
        return sorted(chunk.on_disk if chunk.tier is Tier.DISK else chunk.streams)

    def load(self, chunk: Chunk, names: Sequence[str]) -> dict[str, Tensor]:
        """The chunk's streams ``names`` for compute: its own tensors when resident in memory,
        new host tensors read from its files when on disk."""
        if chunk.tier is not Tier.DISK:
            return {n: chunk.streams[n] for n in names}
        assert self.disk is not None
        return {
            n: self.disk.read(chunk.index, n, chunk.numel, pin=self._pin, dtype=chunk.dtype) for n in names
        }

    def iterate(
        self, names: Callable[[Chunk], Sequence[str]], *, skip: set[int] | None = None
    ) -> Iterator[tuple[Chunk, dict[str, Tensor]]]:
        """Yield ``(chunk, streams)`` for every chunk but the frozen ones and those in ``skip``
        (what the optimizer steps) in use order, reading the next disk chunk on a background
        thread while the caller works on the current one (when ``prefetch``)."""
        pool = self._executor()
        ahead: tuple[Chunk, Future[dict[str, Tensor]]] | None = None
        order = [c for c in self.order if not c.frozen and c.index not in (skip or ())]
        for i, chunk in enumerate(order):
            if ahead is not None and ahead[0] is chunk:
                loaded = ahead[1].result()
            else:
                loaded = self.load(chunk, names(chunk))
            ahead = None
            nxt = order[i + 1] if i + 1 < len(order) else None
            if nxt is not None and nxt.tier is Tier.DISK and pool is not None:
                nxt.state = ChunkState.LOADING
                ahead = (nxt, pool.submit(self.load, nxt, names(nxt)))
            chunk.state = ChunkState.IN_USE
            yield chunk, loaded
            chunk.state = ChunkState.RESIDENT

    def write_back(self, chunk: Chunk, streams: dict[str, Tensor]) -> None:
        """After compute: store the streams back on the chunk's tier (disk chunks write them;
        a frozen chunk is never written back)."""
        if chunk.frozen:
            raise RuntimeError(f"{chunk!r} is frozen: nothing computes new values for it")
        for name, tensor in streams.items():
            if chunk.tier is Tier.DISK or chunk.streams.get(name) is not tensor:
                self._put(chunk, name, tensor)

    # ------------------------------------------------------------------ gradients
    def step_in_backward(self, factor: float | None) -> None:
        """Step disk chunks as their gradient arrives, the gradient times ``factor`` (the
        step's, known before backward); None: every chunk steps at ``step()`` (``early.py``)."""
        if self.early is not None:
            if self.early.pending:
                raise RuntimeError("step_in_backward changed while chunks hold steps not yet committed")
            self.early.close()
        self.early = None if factor is None else EarlySteps(self, factor)

    def add_grad(self, flat_index: int, reduced: Tensor, *, accumulate: bool) -> None:
        """Hand over a FlatParam's reduced gradient shard (summed over ranks): each chunk's
        piece becomes (or, ``accumulate``, is added to) its fp32 gradient stream; a disk chunk
        stepping in backward (``step_in_backward``) steps with it instead."""
        early = self.early
        with torch.no_grad():
            for chunk in self._by_flat[flat_index]:
                self.touch(chunk)
                piece = reduced.detach()[chunk.lo : chunk.hi]
                if accumulate:
                    if early is not None:
                        early.refuse_second(chunk)
                    grad = self.load(chunk, ["grad"])["grad"]
                    grad.add_(piece.to(grad.device, torch.float32))
                else:
                    grad = self.copy_to(piece, Tier.HOST if chunk.tier is Tier.DISK else chunk.tier)
                self._grad_sq[chunk.index] = self._squared_norm(chunk, grad)
                if not accumulate and early is not None and early.takes(chunk):
                    early.step(chunk, grad)
                else:
                    self._put(chunk, "grad", grad)

    def _squared_norm(self, chunk: Chunk, grad: Tensor) -> tuple[float, bool]:
        sq = float(torch.linalg.vector_norm(grad, 2.0).float().cpu().double() ** 2)
        for a, b, w in self._weights[chunk.flat_index] or ():
            lo, hi = max(a, chunk.lo), min(b, chunk.hi)
            if lo < hi:
                sq += (w - 1.0) * float(
                    torch.linalg.vector_norm(grad[lo - chunk.lo : hi - chunk.lo].double(), 2.0)
                ) ** 2
        return sq, sq != sq or sq == float("inf")

    def grad_sq(self) -> tuple[float, bool]:
        """This rank's squared gradient norm (weighted) and whether any piece is not finite
        (frozen chunks have no gradient)."""
        missing = [c.index for c in self.chunks if not c.frozen and c.index not in self._grad_sq]
        if missing:
            raise RuntimeError(
                f"no gradient has been reduced into chunks {missing[:5]} yet; call backward first"
            )
        total, bad = 0.0, False
        for sq, nonfinite in self._grad_sq.values():
            total += sq
            bad = bad or nonfinite
        return total, bad or total != total or total == float("inf")

    def drop_grads(self, flat_index: int) -> None:
        """Forget a FlatParam's gradient streams (after the step, or ``zero_grad``) and the
        steps its chunks took in this backward, not yet committed (a skipped step)."""
        for chunk in self._by_flat[flat_index]:
            if self.early is not None:
                self.early.discard(chunk)
            chunk.streams.pop("grad", None)
            if "grad" in chunk.on_disk:
                assert self.disk is not None
                self.disk.drop(chunk.index, "grad")
                chunk.on_disk.discard("grad")
            self._grad_sq.pop(chunk.index, None)

    # ------------------------------------------------------------------ masters
    def _executor(self) -> ThreadPoolExecutor | None:
        """The background reader (one thread, FIFO), when prefetching and some chunk is on disk."""
        if self.config.prefetch and self._pool is None and any(c.tier is Tier.DISK for c in self.chunks):
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-chunk-prefetch")
        return self._pool

    def read_master_async(self, flat_index: int, out: Tensor) -> Future[None] | None:
        """Start ``read_master`` on the background reader when some of the FlatParam's chunks
        are on disk (None: it ran here, synchronously, as nothing needs reading)."""
        pool = self._executor()
        if pool is None or all(c.tier is not Tier.DISK for c in self._by_flat[flat_index]):
            self.read_master(flat_index, out)
            return None
        return pool.submit(self.read_master, flat_index, out)

    def read_master(self, flat_index: int, out: Tensor) -> None:
        """Fill ``out`` (a FlatParam's shard) with its master values from the chunks (fp32; a
        frozen FlatParam's compute-dtype values, from its shard where the store holds none)."""
        with torch.no_grad():
            if not self._holds[flat_index]:
                out.detach().copy_(self.flats[flat_index].shard.detach())
            for chunk in self._by_flat[flat_index]:
                dst = out.detach()[chunk.lo : chunk.hi]
                if chunk.tier is Tier.DISK and dst.device.type == "cpu" and dst.dtype == chunk.dtype:
                    assert self.disk is not None
                    self.disk.read_into(chunk.index, "master", dst)
                else:
                    dst.copy_(self.load(chunk, ["master"])["master"])

    def master_dtype(self, flat_index: int) -> torch.dtype:
        """The dtype of a FlatParam's master: fp32, a frozen one's compute dtype."""
        flat = self.flats[flat_index]
        return flat.compute_dtype if flat.frozen else torch.float32

    def master(self, flat_index: int) -> Tensor:
        """A FlatParam's master shard in full (``master_dtype``), on its device (a new tensor)."""
        flat = self.flats[flat_index]
        out = torch.empty(flat.layout.shard_numel, dtype=self.master_dtype(flat_index), device=flat.device)
        self.read_master(flat_index, out)
        return out

    def close(self) -> None:
        """Stop the prefetch thread, remove the hook and the disk tier's directory."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.early is not None:
            self.early.close()
        self._hook.remove()
        self._closer()


def _close(disk: DiskTier | None) -> None:
    if disk is not None:
        disk.close()
