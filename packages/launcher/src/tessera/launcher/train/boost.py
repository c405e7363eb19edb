"""``boost(model, optimizer, config)``: apply TP and context parallelism, then PP, then ZeRO /
DP, and return an Engine.

What boost needs to know about the model comes from its `ModelSpec` (registered for its
class, or given). The order matters: the pipeline blocks are found (and checked against an
example) on the serial model, tensor parallelism (1D, 2D, 2.5D, 3D) replaces modules by
their sharded twins (in place, keeping the serial weights' slices), context parallelism
swaps the attention cores for ring or Ulysses attention, the pipeline partitioner then cuts
the blocks into this rank's stages, the layers are compiled (``train.compile``:
``tessera.launcher.train.compiling``) and wrapped for activation checkpointing or offload, and the
optimizer is rebuilt over the parameters this rank still holds, to be sharded by ZeRO over
the data-parallel ranks (dp x cp under context parallelism, whose ranks hold partial sums of
one replica's gradient). Under expert parallelism (``parallel.ep``) every MoE layer's
experts are split over the ep group before tensor parallelism (``tessera.launcher.train.experts``),
and ZeRO shards the expert parameters over the expert-data-parallel group instead.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tessera.comm import Mesh
from tessera.launcher.checkpoint.placement import Placement
from tessera.launcher.config import BoostConfig
from tessera.launcher.families import known  # noqa: F401  (registers the specs of the models Tessera knows)
from tessera.launcher.families.spec import (
    ModelSpec,
    check_blocks,
    example_ids,
    layer_stack,
    model_family,
    model_spec,
    pipeline_blocks,
    refusals,
    tied_blocks,
    vocabulary,
)
from tessera.launcher.train.compiling import compile_layers
from tessera.launcher.train.deferred import DeferredValues, InitFn, has_deferred
from tessera.launcher.train.engine import Engine
from tessera.launcher.train.experts import check_experts, expert_sharding, expert_slices, shard_moe
from tessera.launcher.train.moe_style import check_moe_plan
from tessera.launcher.train.objective import StepLoss, objective
from tessera.launcher.train.recompute import checkpoint_layers, offload_layers
from tessera.launcher.train.twin import shrunken_twin, timed, twin_batch, twin_width
from tessera.launcher.train.verify import Verifier
from tessera.pipeline import PipelineRuntime, build_schedule, partition_by_params, stage_modules
from tessera.tensor_parallel import (
    Plan,
    PlanLike,
    SequenceProbe,
    context_parallelize,
    parallelize,
    shard_specs,
)
from tessera.tensor_parallel.plan import resolve_plan
from tessera.zero import ChunkConfig, ZeroOptimizer

__all__ = ["boost", "rebuild_optimizer"]

log = logging.getLogger(__name__)


def chunk_config(config: BoostConfig, rank: int) -> ChunkConfig | None:
    """The chunk memory manager's settings for global rank ``rank`` (None when the job does not
    use it); each rank's disk chunks go under ``<zero.disk_dir>/rank<k>``."""
    z = config.zero
    if not z.chunked:
        return None
    return ChunkConfig(
        device_budget_mb=z.device_budget_mb or None,
        host_budget_mb=z.host_budget_mb or None,
        disk_dir=Path(z.disk_dir) / f"rank{rank}" if z.disk_dir else None,
        policy=z.policy,
        fractions=(z.fractions[0], z.fractions[1], z.fractions[2]) if z.fractions else None,
        chunk_numel=z.chunk_numel or None,
    )


def _release_others(params: Iterable[nn.Parameter], keep: set[int]) -> None:
    """Empty the parameters other pipeline ranks hold: the caller's model still references
    every block, and without this each rank would keep the whole serial model resident."""
    with torch.no_grad():
        for param in params:
            if id(param) not in keep:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                param.grad = None


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, local: Mapping[str, nn.Parameter], group_of: Mapping[str, int]
) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class, with the same parameter groups and hyperparameters,
    over this rank's parameters ``local`` (by serial name; ``group_of`` maps a serial name to
    its group in ``optimizer``, and leaves out the frozen ones, which it does not hold).

    Tensor and pipeline parallelism replace or drop parameters, so the user's optimizer is
    rebuilt over what this rank holds (a group may be empty on a pipeline rank); it must hold
    no state yet. Adam/AdamW on torch's default implementation are rebuilt fused
    (``_prefers_fused``).
    """
    if optimizer.state:
        raise ValueError("boost() needs a fresh optimizer (it already holds state)")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params" and k in accepted},
            "params": [p for name, p in local.items() if group_of.get(name) == index],
        }
        for index, group in enumerate(optimizer.param_groups)
    ]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if _prefers_fused(optimizer):
        defaults["fused"] = True
        for group in groups:
            group["fused"], group["foreach"] = True, None
    return type(optimizer)(groups, **defaults)


def _prefers_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Adam and AdamW left on torch's default implementation (neither ``foreach`` nor
    ``fused`` given, for any group) step ZeRO's flat shards with the fused kernel: one large
    flat tensor is where the default multi-tensor path is slowest (5M elements here: 84 ms
    against 8.8 ms fused; the results differ from it only in the last bit of some elements)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    settings = [optimizer.defaults, *optimizer.param_groups]
    return all(s.get("fused") is None and s.get("foreach") is None for s in settings)


def _groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The optimizer group of every trainable parameter of ``model``, by serial name
    (ValueError naming the parameters the optimizer lacks or holds twice, or holds beyond
    the model). A frozen parameter (``requires_grad=False``) may be in the optimizer or not:
    it is never stepped (ZeRO keeps it, sharded like the others)."""
    names = dict(model.named_parameters())
    trained = {n: p for n, p in names.items() if p.requires_grad}
    index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    missing = [n for n, p in trained.items() if id(p) not in index]
    held = {id(p) for p in names.values()}
    if missing or count != len(index) or set(index) - held:
        raise ValueError(
            f"boost() needs an optimizer over every trainable parameter of the model, each once: "
            f"missing {missing[:5]}, {count - len(index)} held twice, "
            f"{len(set(index) - held)} not in the model"
        )
    return {n: index[id(p)] for n, p in trained.items()}


def _sequence_probe(model: nn.Module, example: Tensor | None, *, tp: int) -> SequenceProbe | None:
    """What context parallelism's probe of the sequence split feeds ``model``
    (``tessera.tensor_parallel.probe_sequence_split``): token ids below the vocabulary of
    ``example`` (integer ids), else of ``config.vocab_size``, else of the first (vocab-parallel)
    embedding; None (logged) when none is known. ``tp``: Megatron SP's cut of each slice."""
    config = getattr(model, "config", None)
    vocab = vocabulary(model)
    if example is not None and not (example.is_floating_point() or example.is_complex()) and example.numel():
        vocab = int(example.max()) + 1
    if vocab is None or vocab < 1:
        log.info("context parallelism: sequence-split probe skipped: no vocabulary known (pass example=)")
        return None
    limits = [getattr(config, a, None) for a in ("max_position_embeddings", "n_positions")]
    max_len = min((n for n in limits if isinstance(n, int) and n > 0), default=None)
    return SequenceProbe(vocab_size=vocab, multiple=tp, max_len=max_len)


_POSITION_ROLES = ("embedding", "embedding_whole", "sequence_split")


def _position_roles(plan: PlanLike | None) -> str | None:
    """The plan entries whose role is a learned position embedding, as context
    parallelism's ``positions`` patterns (comma-separated); None when the plan names none."""
    if plan is None:
        return None
    entries = plan.entries if isinstance(plan, Plan) else Plan.of(plan).entries
    found = [pattern for pattern, style in entries if style.name in _POSITION_ROLES]
    return ",".join(found) or None


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every further name under which the model's state dict holds a parameter it already
    names (a tied LM head), mapped to the parameter's name in ``named_parameters``."""
    first = {id(p): n for n, p in model.named_parameters()}
    every = model.named_parameters(remove_duplicate=False)
    return {n: first[id(p)] for n, p in every if first[id(p)] != n}


def _verify_on_twin(model: nn.Module, config: BoostConfig, *, spec: ModelSpec, plan: PlanLike | None) -> None:
    """Boost a shrunken twin of ``model`` under ``config`` with ``verify=True`` and train one
    step, which the verifier compares with a serial one (`tessera.launcher.train.twin`)."""
    p = config.parallel
    layers = max(2, p.pp * p.virtual_stages)
    twin = shrunken_twin(model, layers=layers, vocab_multiple=p.tp * p.cp, seed=config.train.seed)
    vocab = vocabulary(twin)
    assert vocab is not None  # an HF config says its vocab_size
    inputs, targets = twin_batch(
        vocab, rows=p.dp * p.microbatches, tokens=16 * p.cp * p.tp, seed=config.train.seed,
        device=next(iter(twin.parameters())).device,
    )  # fmt: skip

    def step() -> None:
        engine = boost(
            twin, torch.optim.SGD(twin.parameters(), lr=0.0), config, spec=spec, plan=plan, verify=True
        )
        try:
            engine.train_step(inputs, targets)
        finally:
            engine.mesh.close()

    timed(f"verify='twin': {type(model).__name__} with {layers} layers of width {twin_width(twin)}", step)


def _check_refusals(model: nn.Module, spec: ModelSpec, p: Any) -> None:
    """ValueError naming each parallel axis in use that the model refuses (`refusals`)."""
    used = {"tp": p.tp > 1, "sequence_parallel": p.sequence_parallel, "pp": p.pp > 1, "cp": p.cp > 1}
    refused = refusals(model, spec, [axis for axis, on in used.items() if on])
    if refused:
        kind = model_family(model) or type(model).__name__
        raise ValueError(f"{type(model).__name__} ({kind}) cannot take " + "; ".join(refused))


def boost(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: BoostConfig,
    *,
    spec: ModelSpec | None = None,
    plan: PlanLike | None = None,
    example: Tensor | None = None,
    scheduler_fn: Any = None,
    verify: bool | Literal["twin"] | None = None,
    init: InitFn | None = None,
    compile: bool | None = None,
) -> Engine:
    """Compose dp x pp x tp x cp x ZeRO for any ``model`` per ``config``; collective over the
    default process group.

    ``spec``: the model contract (`ModelSpec`: pipeline blocks, loss, output, tp plans);
    default: the spec registered for the model's class, else one that fits a plain causal LM.
    ``plan``: the tensor-parallel plan, overriding the spec's. ``example``: a batch of
    inputs; with pipelining, the blocks are first checked to reproduce ``model(example)``;
    under context parallelism its ids give the vocabulary of the sequence-split probe
    (``tessera.tensor_parallel.probe_sequence_split``, run before training on every cp rank).
    ``scheduler_fn(optimizer) -> LRScheduler`` builds the learning-rate schedule on the
    rebuilt optimizer (none by default). ``verify``: compare the first step with a serial step
    of the same model and refuse to train on a mismatch (None: ``train.verify``; see
    ``tessera.launcher.train.verify``; ``"twin"``: verify the same layout on a shrunken twin of a
    Hugging Face model first, then train the model itself unverified: ``tessera.launcher.train.twin``).
    A model built by ``deferred_parameters`` (parameters on the
    meta device) is materialized here, each rank only what it holds, one ZeRO flat buffer at
    a time (``deferred``), by ``init(name, module)`` (default ``deferred.default_init``)
    seeded by ``train.seed``.
    ``compile``: torch.compile each layer of the layer stack on its own, inside checkpointing
    and offload (None: ``train.compile``; see ``tessera.launcher.train.compiling``).
    """
    if compile is not None:  # it stands for train.compile, and is validated as that
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, compile=compile))
    errors = BoostConfig.validate(config)  # the core only: this model is checked against the degrees itself
    if errors:
        raise ValueError("; ".join(errors))
    p = config.parallel
    topology = p.topology()
    check_experts(model, topology.ep)  # before anything changes the model
    spec = spec if spec is not None else model_spec(model)
    _check_refusals(model, spec, p)
    tp_plan = None
    if topology.tp > 1:  # resolved on the serial model: the MoE layers' styles are checked before any group
        tp_plan = (spec if plan is None else ModelSpec(roles=plan)).plan(
            topology.tp_mode, model, depth=topology.tp_depth
        )
        resolved = resolve_plan(model, tp_plan, tp=topology.tp, sequence_parallel=p.sequence_parallel)
        check_moe_plan(model, resolved, sequence_parallel=p.sequence_parallel)
    group_of = _groups_by_name(model, optimizer)  # before any group: a refusal communicates nothing
    mesh = Mesh(topology, combined=[("dp", "cp")] if topology.cp > 1 else [])
    tp, pp, cp = mesh.size("tp"), mesh.size("pp"), mesh.size("cp")
    full_shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    aliases = tied_aliases(model)
    tp_group, pp_group = mesh.group("tp"), mesh.group("pp")
    data_group = mesh.group(("dp", "cp")) if cp > 1 else mesh.group("dp")
    verify = config.train.verify if verify is None else verify
    if verify == "twin":
        _verify_on_twin(model, config, spec=spec, plan=plan)
        verify = False
    verifier = Verifier(model, config, loss=spec.loss, output=spec.output) if verify else None  # before tp
    serial = None
    if has_deferred(model):  # built by ``deferred_parameters``: kept as meta, before tp converts it
        serial = copy.deepcopy(model)
    if pp > 1:  # checked on the serial model, before anything changes it
        serial_blocks = pipeline_blocks(model, spec)
        if len(serial_blocks) < pp * p.virtual_stages:
            raise ValueError(
                f"{type(model).__name__} has {len(serial_blocks)} pipeline blocks, fewer than parallel.pp * "
                f"parallel.virtual_stages = {pp} * {p.virtual_stages}"
            )
        check_blocks(model, serial_blocks, example_ids(model, example), spec.output)
    shard_moe(model, mesh)  # ep > 1: this rank's experts (ZeRO shards them over edp: expert_sharding)
    experts = expert_slices(model)
    if tp_plan is not None:
        parallelize(
            model,
            plan=tp_plan,
            mesh=mesh,
            sequence_parallel=p.sequence_parallel,
            seed=config.train.seed,
        )
    if cp > 1:  # no cores named: its F.scaled_dot_product_attention calls are found and routed
        context_parallelize(
            model,
            mesh.group("cp"),
            mode=p.cp_mode,
            layout=p.cp_layout,
            cores=spec.attention_cores,
            positions=spec.positions or _position_roles(plan if plan is not None else spec.roles),
            probe=_sequence_probe(model, example, tp=tp if p.sequence_parallel else 1),
        )
    if pp > 1:  # the cut, once: tensor parallelism replaced modules, so the blocks are found again
        blocks = pipeline_blocks(model, spec)
        schedule = build_schedule(p.schedule, pp, p.microbatches, p.virtual_stages)
        # several stages per rank: then balance what each rank holds, not only each stage
        partition = partition_by_params(blocks, schedule=schedule)
        stages = stage_modules(blocks, partition, mesh.coordinate("pp"))
    # deferred: ZeRO makes this rank's parameters as it fills its flat buffers, as eager ones
    values = (
        None
        if serial is None
        else DeferredValues(
            serial,
            model,
            seed=config.train.seed,
            init=init,
            tp_rank=mesh.coordinate("tp"),
            tp=tp,
            experts=experts,
        )
    )
    t = config.train
    if t.activation_checkpointing or t.activation_offload or t.compile:
        stack = spec.blocks if isinstance(spec.blocks, str) else layer_stack(model)
        layers = list(model.get_submodule(stack).children())
        if t.compile:  # innermost: checkpointing's recomputation replays its random streams eagerly
            compile_layers(layers)
        if t.activation_offload:
            offload_layers(layers)
        if t.activation_checkpointing:
            checkpoint_layers(layers, every=t.recompute_every, policy=t.recompute_policy)
    goal = objective(mesh, cp_layout=p.cp_layout, loss=spec.loss)
    specs = dict(shard_specs(model))
    named = dict(model.named_parameters())
    names = {id(param): name for name, param in named.items()}
    # how many tp ranks hold each element: tp for a parameter no style split, else what its
    # spec says (1 for a partition, the depth for 2.5D's depth replicas, ...)
    copies = {param: specs[name].replicas(tp) if name in specs else tp for name, param in named.items()}

    stage_to_rank: tuple[int, ...] = ()
    tied: list[tuple[str, nn.Parameter]] = []
    if pp > 1:
        module: nn.Module = nn.ModuleDict({str(s): m for s, m in stages.items()})
        stage_to_rank = schedule.stage_to_rank
        # a weight tied across blocks (embedding and LM head) that lands on several pipeline
        # ranks: each holds a copy, their gradients are summed every step, norms count it once
        for param, where in tied_blocks(blocks).items():
            holders = {partition.rank_of_block(b) for b in where}
            if len(holders) > 1:
                tied.append((names[id(param)], param))
                copies[param] *= len(holders)
        tied.sort(key=lambda item: item[0])
    else:
        module = model
    replicated = {param: n for param, n in copies.items() if n > 1}
    local = list(module.parameters())
    local_ids = {id(param) for param in local}
    if pp > 1:
        _release_others(named.values(), local_ids)
    placement = Placement(
        names={param: names[id(param)] for param in local},
        full_shapes=full_shapes,
        replicated={param: n for param, n in replicated.items() if id(param) in local_ids},
        shard_specs=specs,
        stage_to_rank=stage_to_rank,
        experts=experts,
        aliases=aliases,
    )
    optimizer = rebuild_optimizer(optimizer, {placement.names[p]: p for p in local}, group_of)
    zero = ZeroOptimizer(
        module,
        optimizer,
        stage=config.zero.stage,
        group=data_group,
        average_over=mesh.size("dp"),
        precision=config.train.precision,
        offload=config.zero.offload,
        clip_grad_norm=config.optim.clip_grad_norm if config.optim.clip_grad_norm > 0 else None,
        norm_groups=[g for g, n in ((tp_group, tp), (pp_group, pp)) if n > 1],
        replication=placement.replicated,
        memory=chunk_config(config, mesh.rank),
        sharding=expert_sharding(module, mesh),
        init=values,
        device=mesh.device,
    )
    if values is not None:
        log.info("deferred initialization: this rank made %d parameter elements", values.made)
    step_loss = StepLoss(goal)  # what each microbatch trains on: the engine scales it per step
    runtime = None
    if pp > 1:
        runtime = PipelineRuntime(
            schedule, stages, step_loss, group=pp_group, device=mesh.device, tune_splits=p.tune_splits
        )
    scheduler = scheduler_fn(optimizer) if scheduler_fn is not None else None
    log.info(
        "boosted: %s, zero stage %d, %s; this rank holds %d parameters",
        mesh.topology.describe(),
        config.zero.stage,
        config.train.precision,
        sum(t.numel() for t in local),
    )
    return Engine(
        config=config,
        mesh=mesh,
        module=module,
        zero=zero,
        runtime=runtime,
        scheduler=scheduler,
        objective=goal,
        output=spec.output,
        placement=placement,
        tied=[(name, param, id(param) in local_ids) for name, param in tied],
        max_skipped_steps=config.train.max_skipped_steps,
        verifier=verifier,
        step_loss=step_loss,
    )
