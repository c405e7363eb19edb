"""Free disk for the main job's disk tier and checkpoints, checked before spawning (no torch).

The main job's model is known from ``[model]``, so its state has a size: ``P`` parameters
(the GPT's weights and biases, the head tied to the embedding; a vocabulary of 0 counts 256
characters), fp32 masters, gradients and the optimizer's state (AdamW and Adam: two fp32
moments; SGD: one with momentum). Two estimates, each against
``shutil.disk_usage(...).free`` of the folder's filesystem:

- the disk tier of the chunk manager (``zero.disk_dir``): the share of the chunk bytes it
  holds (``zero.fractions``' third, or what exceeds the budgets filling fastest first), for
  every process of this machine;
- one checkpoint generation in ``train.run_dir``: the rank files (module state, once per
  data-parallel replica below ZeRO-3), the ZeRO shards and the portable state (masters and
  optimizer state, once each). The generations already there are not counted again.

Needed above available is refused, naming the folder and both numbers in MiB; within 2x
of it is a warning.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tessera.launcher.config import Config

__all__ = ["checkpoint_bytes", "disk_problems", "disk_tier_bytes", "model_parameters"]

log = logging.getLogger(__name__)

MIB = 2**20


def model_parameters(config: Config) -> int:
    """The main job's GPT's parameter count from ``[model]`` (the head tied to the embedding)."""
    m = config.model
    d, hidden, vocab = m.d_model, m.mlp_ratio * m.d_model, m.vocab_size or 256
    layer = 4 * d * d + 4 * d + 2 * d * hidden + hidden + d + 4 * d  # attention, mlp, two norms
    return vocab * d + m.seq_len * d + m.n_layers * layer + 2 * d


def _optimizer_bytes(config: Config) -> int:
    """fp32 optimizer state bytes per parameter."""
    name = str(config.optim.name).lower()
    if "adam" in name:
        return 8
    return 4 if config.optim.momentum else 0


def disk_tier_bytes(config: Config, processes: int) -> int:
    """What the chunk manager's disk tier holds for ``processes`` ranks (0 without one)."""
    if not config.zero.disk_dir:
        return 0
    p, par = model_parameters(config), config.parallel
    state = p * (4 + 4 + _optimizer_bytes(config)) // (par.tp * par.pp * par.cp)  # masters, grads, moments
    per_rank = state // par.dp if config.zero.stage >= 1 else state
    fractions = config.zero.fractions
    if len(fractions) == 3:
        on_disk = int(per_rank * fractions[2] / max(sum(fractions), 1e-12))
    elif config.zero.host_budget_mb > 0:
        resident = (config.zero.host_budget_mb + config.zero.device_budget_mb) * MIB
        on_disk = max(0, per_rank - int(resident))
    else:
        on_disk = 0  # the host is not limited: nothing needs the disk
    return on_disk * processes


def checkpoint_bytes(config: Config) -> int:
    """One checkpoint generation of the main job, every rank's files together."""
    p = model_parameters(config)
    module = 2 if "16" in str(config.train.precision) else 4  # bf16, fp16: the model is cast
    rank_files = p * module * config.parallel.dp if config.zero.stage < 3 else 0
    state = p * (4 + _optimizer_bytes(config))
    return rank_files + 2 * state  # the ZeRO shards and the portable state


def _free(path: Path) -> int:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def disk_problems(config: Config, processes: int) -> list[str]:
    """Refusals (returned) and warnings (logged) for the main job's disk needs."""
    checks = [("zero.disk_dir", config.zero.disk_dir, disk_tier_bytes(config, processes), "its disk tier")]
    if config.train.checkpoint_every:
        checks.append(("train.run_dir", config.train.run_dir, checkpoint_bytes(config), "a checkpoint"))
    errors = []
    for field, folder, needed, what in checks:
        if not folder or needed <= 0:
            continue
        free = _free(Path(folder))
        line = (
            f"{field}={folder!r}: {what} needs about {needed / MIB:.1f} MiB, "
            f"{free / MIB:.1f} MiB are free there"
        )
        if needed > free:
            errors.append(line)
        elif 2 * needed > free:
            log.warning("%s (within 2x)", line)
    return errors
