"""The launcher's side of the planner (`tessera.planner`): a `Config` as the planner's
inputs, a chosen `Layout` as a `Config`, and ``parallel.auto = true``.

`job_of` reads the main job's model (``[model]``: the reference GPT; ``vocab_size = 0``, a
vocabulary from the corpus, is planned as `DEFAULT_VOCAB` characters), ``data.batch_size``,
``train.precision``, ``optim.name`` and ``train.activation_checkpointing``; `layout_of`
reads ``[parallel]`` and ``[zero]``; `config_of` is the other way: the base configuration
with its ``[parallel]`` and ``[zero]`` those of the layout (every other ZeRO setting at its
default) and activation checkpointing the layout's. `validator` is the planner's
``validate``: ``Config.validate()`` of `config_of`, so that the search keeps exactly the
layouts the launcher accepts.

Before anything spawns, `auto_launch` resolves the cluster the configuration names
(``parallel.cluster``: a preset, a cluster TOML, or empty for the file ``tessera plan
--calibrate`` wrote at `calibrated_path`, else the ``cpu`` preset, whose device count is this
machine's core count), refusing an unknown one with a ValueError; the world is the
launcher's processes per node (default: the cluster's devices per node) times its nodes.
`auto_config` then replaces the ``[parallel]`` and ``[zero]`` sections and
``train.activation_checkpointing`` by those of the fastest candidate that fits (``search``)
for that world. The result has ``parallel.auto =
false`` and concrete degrees, so every rank's ``load_config()`` and every checkpoint see
exactly what runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tessera.launcher.config import Config, ParallelConfig, ZeroConfig
from tessera.planner import (
    Candidate,
    Cluster,
    Estimate,
    Job,
    Layout,
    ModelShape,
    SearchResult,
    estimate,
    search,
)
from tessera.planner.cluster import calibrated_path, resolve_cluster
from tessera.planner.experts import ExpertShape

__all__ = [
    "DEFAULT_VOCAB",
    "auto_config",
    "auto_launch",
    "calibrated_path",
    "config_of",
    "estimate_config",
    "experts_of",
    "job_of",
    "layout_of",
    "model_of",
    "search_config",
    "validator",
]

DEFAULT_VOCAB = 128  # the main job's vocab_size = 0 means "from the corpus": about this many chars


def model_of(config: Config) -> ModelShape:
    """The reference GPT of ``config.model`` and the batch of ``config.data``."""
    m = config.model
    return ModelShape(
        layers=m.n_layers,
        hidden=m.d_model,
        heads=m.n_heads,
        vocab=m.vocab_size or DEFAULT_VOCAB,
        seq=m.seq_len,
        batch=config.data.batch_size,
        mlp_ratio=m.mlp_ratio,
        dropout=m.dropout > 0,
    )


def job_of(config: Config) -> Job:
    """The planner's job: the model, precision, optimizer and activation checkpointing."""
    return Job(
        model_of(config),
        precision=str(config.train.precision),  # a member's name (StrEnum), or a bad value as given
        optimizer=str(config.optim.name),
        recompute=config.train.activation_checkpointing,
        moe=experts_of(config),
    )


def experts_of(config: Config) -> ExpertShape | None:
    """The planner's shape of ``[moe]`` (the main job's mixtures: every layer's MLP, SwiGLU
    experts and the shared expert of ``[moe]``'s widths), None when it is off."""
    e, m = config.moe, config.model
    if not e.enabled:
        return None
    hidden, shared = e.widths(m.d_model, m.mlp_ratio)
    return ExpertShape(
        layers=m.n_layers,
        experts=e.experts,
        top_k=e.top_k,
        hidden=hidden,
        shared_hidden=shared,
        capacity_factor=None if e.dropless else e.capacity_factor,
    )


def layout_of(config: Config) -> Layout:
    """``config``'s ``[parallel]`` and ``[zero]`` as a planner layout."""
    p, z = config.parallel, config.zero
    return Layout(
        **p.parallelism_values(),
        zero=z.stage,
        offload=z.offload,
        recompute=config.train.activation_checkpointing,
    )


def config_of(base: Config, layout: Layout) -> Config:
    """``base`` run as ``layout``: its ``[parallel]`` the layout's degrees, mode and schedule
    (``auto`` off, no cluster), its ``[zero]`` the layout's stage and offload (the other ZeRO
    settings at their defaults), activation checkpointing the layout's."""
    parallel = ParallelConfig(**layout.parallelism_values())
    train = base.train
    if train.activation_checkpointing != layout.recompute:
        train = dataclasses.replace(train, activation_checkpointing=layout.recompute)
    return dataclasses.replace(
        base, parallel=parallel, zero=ZeroConfig(layout.zero, layout.offload), train=train
    )


def validator(base: Config) -> Callable[[Layout], Sequence[str]]:
    """The planner's ``validate`` for ``base``: ``Config.validate()`` of each layout's config."""

    def validate(layout: Layout) -> Sequence[str]:
        return config_of(base, layout).validate()

    return validate


def search_config(base: Config, cluster: Cluster, **options: Any) -> SearchResult:
    """`search` of ``base``'s job on ``cluster``, each candidate one ``Config.validate()``
    accepts (``options``: `search`'s keywords)."""
    return search(job_of(base), cluster, validate=validator(base), **options)


def estimate_config(config: Config, cluster: Cluster, *, recompute: bool | None = None) -> Estimate:
    """`estimate` of ``config`` as it stands (``recompute``: activation checkpointing, default
    the config's ``train.activation_checkpointing``)."""
    layout = layout_of(config)
    if recompute is not None:
        layout = dataclasses.replace(layout, recompute=recompute)
    return estimate(layout, job_of(config), cluster)


def auto_config(config: Config, world: int, cluster: Cluster | None = None) -> tuple[Config, Candidate]:
    """``config`` with the planner's parallel layout and ZeRO settings for ``world`` ranks of
    ``cluster`` (default: the one ``parallel.cluster`` names), and the chosen candidate;
    ValueError naming the world when nothing fits, or naming an unknown cluster."""
    cluster = resolve_cluster(config.parallel.cluster) if cluster is None else cluster
    if world < 1:
        raise ValueError(f"parallel.auto needs a world of at least 1 rank, got {world}")
    result = search_config(config, cluster, world=world, recompute=(False, True))
    best = result.best
    if best is None:
        raise ValueError(
            f"parallel.auto: no configuration of this model fits {world} rank(s) of {cluster.name} "
            f"({cluster.memory_gib:g} GiB each; {result.invalid} refused by validation, "
            f"{len(result.too_big) + result.overflow} too big)"
        )
    planned = config_of(config, best.layout)
    parallel = dataclasses.replace(planned.parallel, auto=False, cluster=config.parallel.cluster)
    # the candidate's memory was predicted with or without recomputation: run it the same way
    chosen = dataclasses.replace(config, parallel=parallel, zero=planned.zero, train=planned.train)
    return chosen, best


def auto_launch(config: Config, nproc_per_node: int | None, nnodes: int) -> tuple[Config, Candidate, int]:
    """What the launcher runs for ``parallel.auto``: (the chosen config, its candidate, the
    processes per node), planned on ``parallel.cluster`` for ``nproc_per_node`` (default the
    cluster's devices per node) times ``nnodes`` ranks; ValueError for an unknown cluster or
    when nothing fits."""
    cluster = resolve_cluster(config.parallel.cluster)
    per_node = nproc_per_node or cluster.devices_per_node
    chosen, best = auto_config(config, per_node * nnodes, cluster)
    return chosen, best, per_node
