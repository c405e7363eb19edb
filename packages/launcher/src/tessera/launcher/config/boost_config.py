"""The core configuration: what ``boost()`` and the `Engine` read (`BoostConfig`), and its sections.

Sections are frozen dataclasses: ``[parallel]``, ``[zero]``, ``[optim]``, ``[train]`` and
``[logging]``. ``validate()`` returns every mistake as one line naming the field and the
numbers (or the allowed names of a choice: ``tessera.launcher.config.choices``), so a launcher can
refuse a job before anything spawns. The main job's `Config` (``main_config``) adds its
``[model]`` and ``[data]``; ``tessera.launcher.config`` exports both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tessera.comm import Parallelism, Topology, TPGrid
from tessera.launcher.config.choices import (
    LogLevel,
    OptimName,
    RecomputePolicy,
    choice_problems,
    coerce_choices,
)
from tessera.launcher.config.compile_rules import compile_problems
from tessera.launcher.config.world_rule import AUTO, AUTO_FIELDS, auto_degrees, auto_problems
from tessera.pipeline import SCHEDULES, schedule_spec
from tessera.zero.chunks.config import Policy, chunk_problems
from tessera.zero.precisions import Precision

__all__ = [
    "BoostConfig",
    "LoggingConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "ZeroConfig",
]


@dataclass(frozen=True, slots=True)
class ParallelConfig(Parallelism):
    """Degrees of parallelism and the pipeline schedule (`tessera.comm.Parallelism`, which the
    planner's ``Layout`` is too), and how the launcher picks them. world size = dp * pp * tp * cp.
    One of dp, pp, tp and cp may be -1 ("auto" in TOML, the environment and ``--set``): it is
    inferred from the world size, and with none set (all 1) dp fills the world
    (``tessera.launcher.config.world_rule``); until the world size is known, ``validate()`` checks
    each field alone.

    ``tp_mode`` (`tessera.comm.TPMode`): "1d" (Megatron), "2d" (SUMMA over a q x q grid,
    tp = q*q), "2.5d" (Tesseract, tp = q*q*tp_depth) or "3d" (a q x q x q cube, tp = q**3).
    ``cp_mode``, ``cp_layout``, ``sequence_parallel``, ``schedule``, ``microbatches``,
    ``virtual_stages`` and ``tune_splits``: `tessera.comm.Parallelism`; a schedule's name is one
    registered in ``tessera.pipeline.SCHEDULES`` (users may register their own).
    ``auto``: the launcher replaces this section and ``[zero]`` by the planner's choice for
    the world it launches (``tessera.launcher.config.auto``) before anything spawns, planned
    for ``cluster``: a preset ("cpu", "a100-80g", ...) or a cluster TOML file; empty: the file
    ``tessera plan --calibrate`` writes (``plan.cluster.calibrated_path``) if there is one,
    else the ``cpu`` preset. The launcher refuses an unknown cluster before anything spawns.
    ``ep`` > 1: expert parallelism over the data-parallel ranks (ep divides dp): every
    ``tessera.moe.MoE`` layer's experts are split over ``ep`` consecutive dp ranks, and ZeRO
    shards expert parameters over the ``dp / ep`` ranks that hold the same experts.
    """

    auto: bool = False
    cluster: str = ""

    def __post_init__(self) -> None:
        coerce_choices(self)

    def grid(self) -> TPGrid:
        """The tensor-parallel grid of ``tp``, ``tp_mode`` and ``tp_depth`` (`tessera.comm.TPGrid`:
        its side, how many ways widths split, how many blocks a microbatch's rows split into);
        ValueError naming them when they make none."""
        return TPGrid.of(self.tp_mode, self.tp, self.tp_depth)

    def topology(self) -> Topology:
        """The degrees as the one validated `Topology` (ValueError naming a bad degree or mode)."""
        return Topology(**self.degree_values())


@dataclass(frozen=True, slots=True)
class ZeroConfig:
    """Data parallelism by ZeRO stage: 0 (plain DP: replicated state) to 3, CPU offload, and
    the chunk memory manager (``tessera.zero.chunks``), which is on when a budget or
    ``disk_dir`` is given.

    ``host_budget_mb`` / ``device_budget_mb``: what model data may hold on that tier per rank
    (0: the host is not limited / no device tier); ``disk_dir``: a directory for the disk
    tier (each rank writes under ``rank<k>/``; "": no disk tier); ``policy``
    (`tessera.zero.chunks.Policy`): "static"
    (``fractions`` = device, host, disk shares of the chunk bytes, or () to fill the tiers
    fastest first) or "auto" (the warm-up step measures what training needs besides model
    data); ``chunk_numel``: elements per chunk (0: searched); ``step_in_backward``: without
    clipping (``optim.clip_grad_norm = 0``) and fp16, disk chunks step as their gradient
    arrives, so gradients never go to disk (the same values; ``tessera.zero.chunks.early``).
    """

    stage: int = 0
    offload: bool = False
    host_budget_mb: float = 0.0
    device_budget_mb: float = 0.0
    disk_dir: str = ""
    policy: Policy = Policy.STATIC
    fractions: tuple[float, ...] = ()
    chunk_numel: int = 0
    step_in_backward: bool = True

    def __post_init__(self) -> None:
        coerce_choices(self)

    @property
    def chunked(self) -> bool:
        """Whether the chunk memory manager places this job's model data."""
        return self.host_budget_mb > 0 or self.device_budget_mb > 0 or bool(self.disk_dir)

    def check_chunks(self) -> list[str]:
        """The chunk manager's settings (``tessera.zero.chunks.chunk_problems``) and how they
        sit with the rest of ``[zero]``, one line per mistake."""
        errors = chunk_problems(
            device_budget_mb=self.device_budget_mb,
            host_budget_mb=self.host_budget_mb,
            disk_dir=self.disk_dir,
            policy=self.policy,
            fractions=self.fractions,
            chunk_numel=self.chunk_numel,
            prefix="zero.",
        )
        if self.fractions and not self.chunked:
            errors.append(
                "zero.fractions is set but no budget and no zero.disk_dir: the chunk manager is off"
            )
        if self.chunked and self.offload:
            errors.append(
                "zero.offload=true and the chunk manager (a budget or zero.disk_dir) exclude each other"
            )
        return errors


@dataclass(frozen=True, slots=True)
class OptimConfig:
    """AdamW (or Adam, SGD: ``name``) with warmup then cosine decay, and global gradient clipping."""

    name: OptimName = OptimName.ADAMW
    lr: float = 3e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    clip_grad_norm: float = 1.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        coerce_choices(self)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """The training loop: length, precision (`tessera.zero.Precision`), seeds, logging,
    evaluation and checkpoints."""

    steps: int = 200
    seed: int = 0
    precision: Precision = Precision.FP32
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0
    run_dir: str = "runs"
    name: str = ""
    resume: str = ""
    sample_chars: int = 300
    watchdog_s: float = 60.0  # end the job when a rank makes no progress this long (0: off)
    compile_watchdog_s: float = 1800.0  # the watchdog's limit while a rank compiles (torch.compile; 0: none)
    keep_last: int = 2  # checkpoint generations kept
    checkpoint_async: bool = False  # write checkpoints in a background thread (Engine.save)
    max_skipped_steps: int = 20  # non-finite steps in a row before the run stops as diverged
    max_restarts: int = 0  # elastic restarts after a rank failure, from the newest generation
    activation_checkpointing: bool = False  # recompute each layer's forward in backward
    recompute_every: int = 1  # with it: checkpoint every k-th layer (1: all)
    recompute_policy: RecomputePolicy = RecomputePolicy.FULL  # or save-matmuls: keep products, attention
    activation_offload: bool = False  # each layer keeps what backward needs in host memory
    verify: bool = False  # compare the first step with a serial one; refuse on a mismatch
    compile: bool = False  # torch.compile each layer of the layer stack on its own (launcher.compiling)

    def __post_init__(self) -> None:
        coerce_choices(self)


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """Log level, and whether every rank (not only rank 0) logs below WARNING."""

    level: LogLevel = LogLevel.INFO
    all_ranks: bool = False

    def __post_init__(self) -> None:
        coerce_choices(self)


@dataclass(frozen=True, slots=True)
class BoostConfig:
    """What ``boost()`` and the `Engine` read: the degrees, ZeRO, the optimizer's settings, the
    training loop and logging. ``load_config()`` gives a script a `Config`, which is one."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def world_size(self) -> int:
        """The number of processes the job needs: dp * pp * tp * cp."""
        return self.parallel.topology().world_size

    def _sections(self) -> tuple[Any, ...]:
        return (self.parallel, self.zero, self.optim, self.train, self.logging)

    def validate(self) -> list[str]:
        """Every mistake in the core sections, one line each (empty when it can run);
        ``BoostConfig.validate(config)`` checks only these of a `Config`."""
        return self._lines(BoostConfig._sections(self), lambda modes: BoostConfig._rules(self, modes=modes))

    def _lines(self, sections: tuple[Any, ...], rules: Callable[[bool], list[str]]) -> list[str]:
        """Each field of ``sections`` (numbers, choices), then, when they hold, ``rules``."""
        errors: list[str] = []
        choices: list[str] = []  # a name that is no member of its enum

        def need(cond: bool, message: str) -> None:
            if not cond:
                errors.append(message)

        for section in sections:
            prefix = type(section).__name__.removesuffix("Config").lower()
            choices += choice_problems(section, prefix)
            for f in fields(section):
                value = getattr(section, f.name)
                name = f"{prefix}.{f.name}"
                if name in AUTO_FIELDS and value == AUTO:  # inferred from the world size (world_rule)
                    continue
                if isinstance(value, int) and not isinstance(value, bool):
                    least = (
                        0
                        if f.name
                        in (
                            "seed",
                            "vocab_size",
                            "checkpoint_every",
                            "warmup_steps",
                            "stage",
                            "max_skipped_steps",
                            "max_restarts",
                            "chunk_numel",
                            "tune_splits",
                            "expert_hidden",  # 0: the dense width
                            "shared_hidden",  # 0: no shared expert
                        )
                        else 1
                    )
                    auto = " (or -1: inferred from the world size)" if name in AUTO_FIELDS else ""
                    need(value >= least, f"{name} must be >= {least}, got {value}{auto}")
                if isinstance(value, float):
                    need(math.isfinite(value), f"{name}={value} must be a finite number")
        if errors:  # the checks below divide by these numbers
            return choices + errors
        degrees = self.parallel.degree_values()
        if auto_degrees(degrees):  # the rules between fields wait for the world size
            return choices + auto_problems(degrees)
        modes = not any(line.startswith("parallel.") for line in choices)  # the degrees' own rules
        return list(dict.fromkeys(choices + rules(modes)))  # zero.policy: the chunks' rule too

    def _expert_rules(self) -> list[str]:
        """What expert parallelism (parallel.ep > 1) does not compose with yet."""
        p, z = self.parallel, self.zero
        if p.ep == 1:
            return []
        refused = [
            (p.cp > 1, f"parallel.ep={p.ep} with parallel.cp={p.cp} (context parallelism) is not built"),
            (p.auto, f"parallel.ep={p.ep} with parallel.auto is not built: the planner places no experts"),
            (z.chunked, f"parallel.ep={p.ep} with the chunk memory manager (budgets, disk_dir) is not built"),
            (z.offload, f"parallel.ep={p.ep} with zero.offload is not built"),
        ]
        return [message for bad, message in refused if bad]

    def _rules(self, *, modes: bool) -> list[str]:
        """The rules between fields, once each field holds a number or a member."""
        p, t, errors = self.parallel, self.train, list[str]()

        def need(cond: bool, message: str) -> None:
            if not cond:
                errors.append(message)

        if modes and p.dp % p.ep:
            errors.append(
                f"parallel.ep={p.ep} must divide parallel.dp={p.dp} (expert-parallel ranks are dp ranks)"
            )
        elif modes:
            try:
                p.topology()
            except ValueError as e:
                errors.append(f"parallel (tp={p.tp}, tp_mode={p.tp_mode}): {e}")
            else:
                need(
                    p.tp_mode.whole_rows or not (p.sequence_parallel or p.cp > 1),
                    f"tp_mode {p.tp_mode} with parallel.sequence_parallel or parallel.cp > 1 is not built",
                )
                errors += self._expert_rules()
        need(
            p.schedule in SCHEDULES,
            f"parallel.schedule={p.schedule!r} is not one of {', '.join(sorted(SCHEDULES))}",
        )
        if p.schedule in SCHEDULES:
            rules = schedule_spec(p.schedule).check(p.pp, p.microbatches, p.virtual_stages)
            errors += [f"parallel (pp={p.pp}, microbatches={p.microbatches}): {line}" for line in rules]
        need(0 <= self.zero.stage <= 3, f"zero.stage={self.zero.stage} must be 0, 1, 2 or 3")
        errors += self.zero.check_chunks()
        need(self.optim.lr > 0, f"optim.lr={self.optim.lr} must be > 0")
        need(t.watchdog_s >= 0, f"train.watchdog_s={t.watchdog_s} must be >= 0 (0: off)")
        need(
            t.compile_watchdog_s >= 0,
            f"train.compile_watchdog_s={t.compile_watchdog_s} must be >= 0 (0: no limit while compiling)",
        )
        need(
            t.activation_checkpointing
            or (t.recompute_every == 1 and t.recompute_policy is RecomputePolicy.FULL),
            "train.recompute_every / recompute_policy need train.activation_checkpointing = true",
        )
        need(
            t.recompute_policy is not RecomputePolicy.SAVE_MATMULS or (p.tp == 1 and p.cp == 1),
            "train.recompute_policy='save-matmuls' needs parallel.tp = 1 and cp = 1: a collective that "
            "reduces a product in place would change the product it keeps",
        )
        if t.compile:
            errors += compile_problems(p.pp, p.schedule, p.microbatches, p.virtual_stages)
        return errors
