"""One typed configuration for a Tessera job, and its validation.

Sections are frozen dataclasses. `BoostConfig` holds what ``boost()`` and the engine read
(``[parallel]``, ``[zero]``, ``[optim]``, ``[train]``, ``[logging]``); `Config`, the one
``tessera`` resolves, adds the main job's ``[model]`` and ``[data]``. ``validate()`` returns
every mistake as one line naming the field and the numbers (or the allowed names of a choice:
``tessera.launcher.choices``), so a launcher can refuse a job before anything spawns.
Loading (TOML file, then environment, then command-line flags) lives in ``config_io``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tessera.comm import Topology, TPGrid, TPMode
from tessera.comm.sequence_modes import Layout as ContextLayout
from tessera.comm.sequence_modes import Mode as ContextMode
from tessera.comm.sequence_modes import sequence_chunks
from tessera.launcher.choices import LogLevel, OptimName, RecomputePolicy, choice_problems, coerce_choices
from tessera.pipeline import SCHEDULES, schedule_spec
from tessera.zero.chunks.config import Policy, chunk_problems
from tessera.zero.precisions import Precision

__all__ = [
    "BoostConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "ZeroConfig",
]


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Degrees of parallelism and the pipeline schedule. world size = dp * pp * tp * sp.

    ``tp_mode`` (`tessera.comm.TPMode`): "1d" (Megatron), "2d" (SUMMA over a q x q grid,
    tp = q*q), "2.5d" (Tesseract, tp = q*q*tp_depth) or "3d" (a q x q x q cube, tp = q**3).
    ``sp`` > 1: context parallelism, ``sp_mode`` "ring" or "ulysses", ``sp_layout``
    "contiguous" or "zigzag" (balances causal attention over the ranks): the
    ``tessera.tensor_parallel.context`` enums ``Mode`` and ``Layout``. ``schedule``: a name
    registered in ``tessera.pipeline.SCHEDULES`` (users may register their own).
    ``tune_splits``: a split-backward schedule (zb-h1, zbv) times its first steps split and
    unsplit, this many pairs of steps after a warm-up, then a merge that keeps a split only
    where the simulated step under the measured costs gains (`tessera.pipeline.merge_splits`)
    against the better of the two, and runs the faster from then on
    (`tessera.pipeline.tune`); 0: every split.
    ``auto``: the launcher replaces this section and ``[zero]`` by the planner's choice for
    the world it launches (``tessera.launcher.plan.auto``) before anything spawns, planned
    for ``cluster``: a preset ("cpu", "a100-80g", ...) or a cluster TOML file; empty: the file
    ``tessera plan --calibrate`` writes (``plan.cluster.calibrated_path``) if there is one,
    else the ``cpu`` preset. The launcher refuses an unknown cluster before anything spawns.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    tp_mode: TPMode = TPMode.ONE_D
    tp_depth: int = 1
    sp_mode: ContextMode = ContextMode.RING
    sp_layout: ContextLayout = ContextLayout.CONTIGUOUS
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    tune_splits: int = 2
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
        return Topology(
            dp=self.dp, pp=self.pp, tp=self.tp, sp=self.sp, tp_mode=self.tp_mode, depth=self.tp_depth
        )


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
    data); ``chunk_numel``: elements per chunk (0: searched).
    """

    stage: int = 0
    offload: bool = False
    host_budget_mb: float = 0.0
    device_budget_mb: float = 0.0
    disk_dir: str = ""
    policy: Policy = Policy.STATIC
    fractions: tuple[float, ...] = ()
    chunk_numel: int = 0

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
class ModelConfig:
    """The character-level GPT of the main job (vocab_size 0: taken from the corpus)."""

    vocab_size: int = 0
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0


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
class DataConfig:
    """Where the text comes from ("stdlib": the Python standard library's source files).

    ``path`` (the user's own data, in place of ``corpus`` and ``max_chars``): a file, a folder
    or a glob of ``.txt`` / ``.jsonl`` files (the text under ``field``) or of pre-tokenized
    ``.bin`` files (ids of ``token_dtype``, or as a ``meta.json`` beside them says);
    ``tokenizer``: "char", "byte" or the path of a Hugging Face ``tokenizer.json``; text is
    tokenized once into ``prepared`` (empty: under ``train.run_dir/data``). See
    ``tessera.launcher.prepare``.
    """

    corpus: str = "stdlib"
    max_chars: int = 2_000_000
    batch_size: int = 16
    val_fraction: float = 0.05
    path: str = ""
    field: str = "text"
    tokenizer: str = "char"
    token_dtype: str = ""
    prepared: str = ""


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
    keep_last: int = 2  # checkpoint generations kept
    checkpoint_async: bool = False  # write checkpoints in a background thread (Engine.save)
    max_skipped_steps: int = 20  # non-finite steps in a row before the run stops as diverged
    max_restarts: int = 0  # elastic restarts after a rank failure, from the newest generation
    activation_checkpointing: bool = False  # recompute each layer's forward in backward
    recompute_every: int = 1  # with it: checkpoint every k-th layer (1: all)
    recompute_policy: RecomputePolicy = RecomputePolicy.FULL  # or save-matmuls: keep products, attention
    activation_offload: bool = False  # each layer keeps what backward needs in host memory
    verify: bool = False  # compare the first step with a serial one; refuse on a mismatch

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
        """The number of processes the job needs: dp * pp * tp * sp."""
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
                        )
                        else 1
                    )
                    need(value >= least, f"{name} must be >= {least}, got {value}")
                if isinstance(value, float):
                    need(math.isfinite(value), f"{name}={value} must be a finite number")
        if errors:  # the checks below divide by these numbers
            return choices + errors
        modes = not any(line.startswith("parallel.") for line in choices)  # the degrees' own rules
        return list(dict.fromkeys(choices + rules(modes)))  # zero.policy: the chunks' rule too

    def _rules(self, *, modes: bool) -> list[str]:
        """The rules between fields, once each field holds a number or a member."""
        p, t, errors = self.parallel, self.train, list[str]()

        def need(cond: bool, message: str) -> None:
            if not cond:
                errors.append(message)

        if modes:
            try:
                p.topology()
            except ValueError as e:
                errors.append(f"parallel (tp={p.tp}, tp_mode={p.tp_mode}): {e}")
            else:
                need(
                    p.tp_mode is TPMode.ONE_D or not (p.sequence_parallel or p.sp > 1),
                    f"tp_mode {p.tp_mode} with parallel.sequence_parallel or parallel.sp > 1 is not built",
                )
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
            t.activation_checkpointing
            or (t.recompute_every == 1 and t.recompute_policy is RecomputePolicy.FULL),
            "train.recompute_every / recompute_policy need train.activation_checkpointing = true",
        )
        need(
            t.recompute_policy is not RecomputePolicy.SAVE_MATMULS or (p.tp == 1 and p.sp == 1),
            "train.recompute_policy='save-matmuls' needs parallel.tp = 1 and sp = 1: a collective that "
            "reduces a product in place would change the product it keeps",
        )
        return errors


@dataclass(frozen=True, slots=True)
class Config(BoostConfig):
    """The configuration ``tessera`` resolves (TOML, environment, ``--set``): the core sections
    of `BoostConfig` and the main job's own ``[model]`` (the reference GPT's sizes) and
    ``[data]`` (its text and global batch). ``boost()`` reads only the core: a user's model is
    checked against the degrees by ``boost()`` itself; ``validate()`` here also checks the
    degrees against ``[model]`` and ``[data]`` for ``tessera train``, ``plan`` and
    ``prepare-data``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> list[str]:
        """Every mistake in the configuration, the main job's sections included, one line each."""
        return self._lines(self._sections(), lambda modes: self._rules(modes=modes))

    def _sections(self) -> tuple[Any, ...]:
        return (*BoostConfig._sections(self), self.model, self.data)

    def _rules(self, *, modes: bool) -> list[str]:
        p, d = self.parallel, self.data
        errors = BoostConfig._rules(self, modes=modes)
        try:
            grid = p.grid() if modes else None
            p.topology()
        except ValueError:  # reported by the core rules
            grid = None
        if grid is not None and grid.row_blocks > 1:
            rows = d.batch_size // max(1, p.dp * p.microbatches)
            if rows % grid.row_blocks:
                errors.append(
                    f"tp_mode {p.tp_mode} splits each microbatch's {rows} rows (data.batch_size / (dp * "
                    f"microbatches)) into {grid.row_blocks} blocks: not divisible"
                )
        if grid is not None and p.sp > 1:
            errors += self._check_context_model()
        errors += self._check_model()
        per_step = p.dp * p.microbatches
        if d.batch_size % per_step:
            errors.append(
                f"data.batch_size={d.batch_size} is not divisible by parallel.dp * parallel.microbatches "
                f"= {p.dp} * {p.microbatches} = {per_step}"
            )
        if not 0.0 < d.val_fraction < 1.0:
            errors.append(f"data.val_fraction={d.val_fraction} must be in (0, 1)")
        return errors

    def _check_context_model(self) -> list[str]:
        """Context parallelism against the ``[model]`` section (the main job's model)."""
        p, m, errors = self.parallel, self.model, []
        chunks = sequence_chunks(p.sp, p.sp_layout, tp=p.tp, sequence_parallel=p.sequence_parallel)
        if m.seq_len % chunks:
            errors.append(
                f"model.seq_len={m.seq_len} does not split into {chunks} equal chunks (sp={p.sp}, "
                f"layout {p.sp_layout}{', times tp for sequence_parallel' if p.sequence_parallel else ''})"
            )
        if p.sp_mode == "ulysses" and (m.n_heads // p.tp) % p.sp:
            errors.append(
                f"parallel.sp_mode=ulysses needs the heads per tp rank ({m.n_heads} / tp={p.tp}) divisible "
                f"by parallel.sp={p.sp}"
            )
        if m.dropout > 0:
            errors.append(f"model.dropout={m.dropout}: context parallel attention has no dropout; use 0")
        return errors

    def _check_model(self) -> list[str]:
        """The degrees against the ``[model]`` section (the main job's model)."""
        p, m, errors = self.parallel, self.model, list[str]()

        def need(cond: bool, message: str) -> None:
            if not cond:
                errors.append(message)

        blocks = m.n_layers + 2
        need(
            blocks >= p.pp * p.virtual_stages,
            f"model.n_layers={m.n_layers} gives {blocks} blocks (with embedding and head), fewer than "
            f"parallel.pp * parallel.virtual_stages = {p.pp} * {p.virtual_stages}",
        )
        need(
            m.d_model % m.n_heads == 0,
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}",
        )
        try:  # how many ways heads and widths split
            split = p.grid().width_split
        except ValueError:  # no valid grid: the core rules report it
            split = p.tp if p.tp_mode is TPMode.ONE_D else 1
        need(
            m.n_heads % split == 0,
            f"model.n_heads={m.n_heads} does not split {split} ways (parallel.tp={p.tp})",
        )
        need(
            (m.mlp_ratio * m.d_model) % split == 0,
            f"model.mlp_ratio * model.d_model = {m.mlp_ratio * m.d_model} does not split {split} ways "
            f"(parallel.tp={p.tp})",
        )
        if p.sequence_parallel:
            need(
                m.seq_len % p.tp == 0,
                f"model.seq_len={m.seq_len} is not divisible by parallel.tp={p.tp} (sequence parallel)",
            )
        need(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
        return errors
