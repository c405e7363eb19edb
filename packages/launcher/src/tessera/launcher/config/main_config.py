"""The main job's configuration (``tessera train``, ``plan``, ``prepare-data``): `Config`, the
core `BoostConfig` with the reference GPT's ``[model]``, the text and global batch of
``[data]``, its mixture of experts ``[moe]``, and the rules between them and the degrees.
``tessera`` resolves a `Config`; ``boost()`` reads only its core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.comm.sequence_modes import sequence_chunks
from tessera.launcher.config.boost_config import BoostConfig
from tessera.launcher.config.finetune_config import FinetuneConfig

__all__ = ["Config", "DataConfig", "MoEConfig", "ModelConfig"]


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
class DataConfig:
    """Where the text comes from ("stdlib": the Python standard library's source files).

    ``path`` (the user's own data, in place of ``corpus`` and ``max_chars``): a file, a folder
    or a glob of ``.txt`` / ``.jsonl`` files (the text under ``field``) or of pre-tokenized
    ``.bin`` files (ids of ``token_dtype``, or as a ``meta.json`` beside them says);
    ``tokenizer``: "char", "byte" or the path of a Hugging Face ``tokenizer.json``; text is
    tokenized once into ``prepared`` (empty: under ``train.run_dir/data``). See
    ``tessera.launcher.data.prepare``.
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
class MoEConfig:
    """The main job's mixture of experts (``enabled``: every layer's MLP is a
    ``tessera.moe.MoE`` of ``experts`` SwiGLU experts of width ``expert_hidden``, 0: the dense
    MLP's ``model.mlp_ratio * d_model``, each token to ``top_k`` of them, plus an always-on
    shared expert of width ``shared_hidden`` when it is above 0: many narrow experts and a
    shared one are DeepSeek-MoE's layout). ``capacity_factor``: each expert keeps at most
    ``ceil(factor * tokens * top_k / experts)`` of a call's assignments (``dropless``: all).
    ``aux_loss_coef`` / ``z_loss_coef``: the load-balancing and router z-losses' weights,
    trained from inside each layer (``tessera.moe.aux``)."""

    enabled: bool = False
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    expert_hidden: int = 0
    shared_hidden: int = 0

    def widths(self, d_model: int, mlp_ratio: int) -> tuple[int, int]:
        """Each expert's hidden width and the shared expert's (0: none)."""
        return self.expert_hidden or mlp_ratio * d_model, self.shared_hidden


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
    moe: MoEConfig = field(default_factory=MoEConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def validate(self) -> list[str]:
        """Every mistake in the configuration, the main job's sections included, one line each."""
        return self._lines(self._sections(), lambda modes: self._rules(modes=modes))

    def validate_fields(self) -> list[str]:
        """For a script with its own model (``tessera run``): the core's mistakes and each field
        of ``[model]`` and ``[data]`` on its own (a script may read them), without the main
        job's rules that tie its model and batch to the degrees (the script's ``boost()``
        checks its own model)."""
        return self._lines(self._sections(), lambda modes: BoostConfig._rules(self, modes=modes))

    def _sections(self) -> tuple[Any, ...]:
        return (*BoostConfig._sections(self), self.model, self.data, self.moe, self.finetune)

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
        if grid is not None and p.cp > 1:
            errors += self._check_context_model()
        errors += self._check_model()
        errors += self._check_moe()
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
        chunks = sequence_chunks(p.cp, p.cp_layout, tp=p.tp, sequence_parallel=p.sequence_parallel)
        if m.seq_len % chunks:
            errors.append(
                f"model.seq_len={m.seq_len} does not split into {chunks} equal chunks (cp={p.cp}, "
                f"layout {p.cp_layout}{', times tp for sequence_parallel' if p.sequence_parallel else ''})"
            )
        if p.cp_mode == "ulysses" and (m.n_heads // p.tp) % p.cp:
            errors.append(
                f"parallel.cp_mode=ulysses needs the heads per tp rank ({m.n_heads} / tp={p.tp}) divisible "
                f"by parallel.cp={p.cp}"
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
            split = 1
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

    def _check_moe(self) -> list[str]:
        """The ``[moe]`` section, when on, and the degrees it composes with."""
        p, e = self.parallel, self.moe
        if not e.enabled:
            return (
                [f"parallel.ep={p.ep} needs moe.enabled: the main job's model has no experts"]
                if p.ep > 1
                else []
            )
        refused = [
            (e.top_k > e.experts, f"moe.top_k={e.top_k} is more than moe.experts={e.experts}"),
            (e.capacity_factor <= 0, f"moe.capacity_factor={e.capacity_factor} must be > 0"),
            (e.aux_loss_coef < 0, f"moe.aux_loss_coef={e.aux_loss_coef} must be >= 0"),
            (e.z_loss_coef < 0, f"moe.z_loss_coef={e.z_loss_coef} must be >= 0"),
            (e.experts % p.ep != 0, f"moe.experts={e.experts} is not divisible by parallel.ep={p.ep}"),
            (p.cp > 1, f"moe.enabled with parallel.cp={p.cp}: context parallelism with MoE is not built"),
        ]
        return [message for bad, message in refused if bad]
