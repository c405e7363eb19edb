"""``ChunkConfig``: where the chunk memory manager may put model data, and how much of it.

Budgets are in MiB. ``device_budget_mb=None``: the device tier is not used (it never is
without an accelerator); ``host_budget_mb=None``: the host is not limited; ``disk_dir=None``:
no disk tier. Under ``policy="static"`` a budget is
what chunks (and the host's staging buffers) may hold on that tier, and ``fractions`` say
which share of the chunk bytes goes to the device, the host and the disk, in the order the
chunks are used. Under ``policy="auto"`` a budget is the tier's whole allowance: the first
``step()`` (the warm-up) measures the memory training needs besides model data (activations,
gathered stage-3 units, reduce buffers) and the chunks get what is left, the ones used first
on the fastest tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

__all__ = ["MIB", "ChunkConfig", "Policy", "chunk_problems"]

MIB = 2**20


class Policy(StrEnum):
    """How chunks are placed: by the configured shares (``static``) or by the free memory the
    warm-up step measures (``auto``)."""

    STATIC = "static"
    AUTO = "auto"


_ALIGN = 64  # chunk sizes are multiples of this many elements


@dataclass(frozen=True, slots=True)
class ChunkConfig:
    """Budgets per tier, the disk directory, the placement policy and the chunk size.

    ``chunk_numel``: elements of one chunk (per stream: master, gradient, each optimizer
    state tensor), rounded up to a multiple of 64; ``None`` (or 0) searches it (the largest power of
    two up to 2**22 whose working set (two staging chunks and the optimizer's scratch) takes
    at most a quarter of the host budget).
    ``fractions``: (device, host, disk) shares of the chunk bytes for ``static``; ``None``
    fills the device, then the host, then the disk up to their budgets.
    ``prefetch``: read the next disk chunk on a background thread while one is stepped.
    ``step_in_backward``: where the step's factor is known before backward (no clipping, no
    fp16 loss scaling), disk chunks step as their gradient arrives and commit at ``step()``,
    so their gradients never go to disk (``tessera.zero.chunks.early``; the same values).
    """

    device_budget_mb: float | None = None
    host_budget_mb: float | None = None
    disk_dir: str | Path | None = None
    policy: Policy = Policy.STATIC
    fractions: tuple[float, float, float] | None = None
    chunk_numel: int | None = None
    prefetch: bool = True
    step_in_backward: bool = True

    def __post_init__(self) -> None:
        if self.policy in set(Policy):  # a name ("auto") is the member
            object.__setattr__(self, "policy", Policy(self.policy))
        problems = chunk_problems(
            device_budget_mb=self.device_budget_mb,
            host_budget_mb=self.host_budget_mb,
            disk_dir=self.disk_dir,
            policy=self.policy,
            fractions=self.fractions,
            chunk_numel=self.chunk_numel,
            prefetch=self.prefetch,
        )
        if problems:
            raise ValueError("; ".join(problems))

    def budget_bytes(self, tier: str) -> int | None:
        """The budget of ``tier`` ("device" or "host") in bytes, or None when unbounded/unused."""
        value = self.device_budget_mb if tier == "device" else self.host_budget_mb
        return None if value is None else round(value * MIB)

    def numel_for(self, largest_shard: int, elem_bytes: int) -> int:
        """The chunk size in elements: ``chunk_numel`` rounded up to 64, or searched: the largest
        power of two up to 2**22 (and not above the largest shard) whose working set (three
        chunks of ``elem_bytes`` per element) takes at most a quarter of the host budget."""
        if self.chunk_numel:  # 0 and None: searched
            return -(-self.chunk_numel // _ALIGN) * _ALIGN
        cap = 2**22
        host = self.budget_bytes("host")
        while cap > _ALIGN and (
            cap // 2 >= largest_shard or (host is not None and 3 * cap * elem_bytes > host // 4)
        ):
            cap //= 2
        return cap


def chunk_problems(
    *,
    device_budget_mb: float | None,
    host_budget_mb: float | None,
    disk_dir: str | Path | None,
    policy: str,
    fractions: tuple[float, ...] | None,
    chunk_numel: int | None,
    prefix: str = "",
    prefetch: bool = True,
) -> list[str]:
    """Every mistake in these chunk manager settings, one line each naming ``prefix`` + the
    field and its value (the launcher checks its ``[zero]`` section with ``prefix="zero."``
    before spawning; ``ChunkConfig`` raises them). A budget of 0 or None and a chunk size of 0
    or None mean "not limited" / "searched"; an empty ``disk_dir`` means no disk tier."""
    errors: list[str] = []
    for name, value in (("host_budget_mb", host_budget_mb), ("device_budget_mb", device_budget_mb)):
        if value is not None and value < 0:
            errors.append(f"{prefix}{name}={value} must be >= 0 (0: not limited / not used)")
    if policy not in set(Policy):
        errors.append(f"{prefix}policy={str(policy)!r} is not one of {', '.join(Policy)}")
    if chunk_numel is not None and chunk_numel < 0:
        errors.append(f"{prefix}chunk_numel must be >= 0, got {chunk_numel}")
    if fractions:
        shares = list(fractions)
        if len(fractions) != 3 or any(f < 0 for f in fractions):
            errors.append(f"{prefix}fractions={shares} must be three shares >= 0 (device, host, disk)")
        elif abs(sum(fractions) - 1.0) > 1e-9:
            errors.append(f"{prefix}fractions={shares} must sum to 1, not {sum(fractions):g}")
        if policy != Policy.STATIC:
            errors.append(
                f"{prefix}fractions are for {prefix}policy='static'; 'auto' places by measured free memory"
            )
        if len(fractions) == 3 and fractions[2] > 0 and not disk_dir:
            errors.append(f"{prefix}fractions={shares} puts chunks on disk but {prefix}disk_dir is empty")
    if chunk_numel is not None and chunk_numel > 0:
        staging = (2 if prefetch else 1) if disk_dir else 0
        errors += _working_set_problems(host_budget_mb, device_budget_mb, staging, chunk_numel, prefix)
    return errors


def _working_set_problems(
    host_mb: float | None, device_mb: float | None, staging: int, numel: int, prefix: str
) -> list[str]:
    """A budget below the smallest working set a chunk size needs, counting each chunk element
    at 8 bytes (fp32 master and gradient: any optimizer's state adds to it, so this never refuses
    what would fit): the ``staging`` chunks of a disk tier (the one in use and the one
    prefetched) and one chunk of the optimizer's scratch on the host; the scratch on the device."""
    chunk = -(-numel // _ALIGN) * _ALIGN * 8
    errors = []
    host_chunks = staging + 1
    if host_mb is not None and host_mb > 0 and host_mb * MIB < host_chunks * chunk:
        what = (
            f"{staging} staging chunks for the disk tier + 1 of optimizer scratch"
            if staging
            else "1 chunk of scratch"
        )
        errors.append(
            f"{prefix}host_budget_mb={host_mb:g} cannot hold the chunk manager's working set: {what}, "
            f"{host_chunks} x {prefix}chunk_numel={numel} x 8 bytes (at least) = "
            f"{host_chunks * chunk / MIB:.4g} MiB; raise the budget or lower {prefix}chunk_numel"
        )
    if device_mb is not None and device_mb > 0 and device_mb * MIB < chunk:
        errors.append(
            f"{prefix}device_budget_mb={device_mb:g} cannot hold the chunk manager's working set: "
            f"1 chunk of optimizer scratch, {prefix}chunk_numel={numel} x 8 bytes (at least) = "
            f"{chunk / MIB:.4g} MiB; raise the budget or lower {prefix}chunk_numel"
        )
    return errors
