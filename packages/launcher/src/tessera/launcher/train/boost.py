"""``boost(model, optimizer, config)``: compose dp x pp x tp x cp x ZeRO around a serial model
and return an Engine, as a sequence of named steps (``docs/design.md`` draws the same flow):

1. ``_checked``: the configuration, the model's spec and refusals, the tensor-parallel plan
   translated for the mode and resolved against the serial model, the optimizer's groups. Pure:
   a refusal here has communicated nothing.
2. ``_mesh``: the process groups of the degrees.
3. ``_serial_references``: what must be taken from the serial model before it changes: the
   verifier's serial copy (``verify``), the pipeline blocks checked against the logits.
4. ``_parallelize``: experts split over ep (``tessera.launcher.train.experts``), tensor
   parallelism (the resolved plan: modules replaced by their sharded twins, keeping the serial
   weights' slices), context parallelism (ring or Ulysses attention).
5. ``_partition``: the pipeline blocks cut into this rank's stages.
6. ``_wrap_layers``: per-layer compile, activation offload and checkpointing.
7. ``_place``: where each parameter this rank holds sits in the serial model (`Placement`).
8. ``_zero``: the optimizer rebuilt over those parameters, sharded by ZeRO over the
   data-parallel ranks (dp x cp under context parallelism, whose ranks hold partial sums of one
   replica's gradient; expert parameters over the expert-data-parallel group).
9. ``_engine``: the objective of the mode (what each rank trains on, its exact loss), the
   pipeline runtime, the Engine.

What boost needs to know about the model comes from its `ModelSpec` (registered for its family
or class, derived from its module tree, or given).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.comm import Mesh, Topology
from tessera.launcher.checkpoint.adapted import Adapters, converted_adapters, read_adapters
from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.checkpoint.placement import Placement, persistent_buffers
from tessera.launcher.checkpoint.tensorfile import Renames
from tessera.launcher.config import BoostConfig
from tessera.launcher.config.world import fit_world
from tessera.launcher.families import known  # noqa: F401  (registers the specs of the models Tessera knows)
from tessera.launcher.families.adapters import peft_config_of, unwrap_peft
from tessera.launcher.families.hf_dtypes import kept_in_fp32
from tessera.launcher.families.hf_moe import hf_moe_conversion
from tessera.launcher.families.hf_names import hf_renames
from tessera.launcher.families.own_moe import Conversion, convert_own_moe
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
from tessera.launcher.train.moe_style import check_moe_plan, split_mixtures
from tessera.launcher.train.objective import StepLoss, objective
from tessera.launcher.train.rebuild import (
    chunk_config,
    groups_by_name,
    rebuild_optimizer,
    release_others,
    tied_aliases,
)
from tessera.launcher.train.recompute import checkpoint_layers, offload_layers
from tessera.launcher.train.same_start import check_same_start
from tessera.launcher.train.twin import shrunken_twin, timed, twin_batch, twin_width
from tessera.launcher.train.verify import Verifier
from tessera.pipeline import (
    Partition,
    PipelineRuntime,
    Schedule,
    build_schedule,
    partition_by_params,
    stage_modules,
)
from tessera.tensor_parallel import (
    Plan,
    PlanLike,
    ResolvedPlan,
    SequenceProbe,
    context_parallelize,
    parallelize,
    resolve,
    shard_specs,
)
from tessera.zero import ZeroOptimizer
from tessera.zero.precision import compute_dtype

__all__ = ["boost", "rebuild_optimizer"]

log = logging.getLogger(__name__)


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
    split = p.topology().dp > 1 or p.cp > 1 or p.microbatches > 1  # any rank's forward sees part of the batch
    used = {
        "tp": p.tp > 1,
        "sequence_parallel": p.sequence_parallel,
        "pp": p.pp > 1,
        "cp": p.cp > 1,
        "batch": split,
    }
    refused = refusals(model, spec, [axis for axis, on in used.items() if on])
    if refused:
        kind = model_family(model) or type(model).__name__
        raise ValueError(f"{type(model).__name__} ({kind}) cannot take " + "; ".join(refused))


@dataclass(frozen=True)
class _Job:
    """What step 1 established about the serial model, before any process group exists."""

    config: BoostConfig
    topology: Topology
    spec: ModelSpec
    plan: PlanLike | None  # the user's plan, overriding the spec's roles
    tp_plan: ResolvedPlan | None  # the mode's plan resolved on the serial model (tp > 1)
    group_of: dict[str, int]  # each trainable parameter's optimizer group, by serial name
    full_shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str]
    exported: dict[str, tuple[ExportPart, ...]]  # trained name -> the user's names (own_moe)
    deferred: nn.Module | None  # a deferred model's meta copy, as the user built it
    buffer_shapes: dict[str, tuple[int, ...]]  # serial shape of every persistent buffer
    adapters: Adapters  # low-rank adapters and their PEFT configurations
    renames: Renames | None  # a Hugging Face checkpoint's names as the model's (read before conversion)
    fp32: frozenset[str]  # parameters and buffers computed in fp32 in any precision (hf_dtypes)


@dataclass(frozen=True)
class _Pipeline:
    blocks: list[nn.Module]
    schedule: Schedule
    partition: Partition
    stages: dict[int, nn.Module]


def _checked(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: BoostConfig,
    spec: ModelSpec | None,
    plan: PlanLike | None,
    adapters: Adapters,
) -> _Job:
    """Step 1 (pure: no group exists yet, so a refusal communicates nothing)."""
    if dist.is_initialized():  # a degree of -1, or dp when none is set, from the default group's size
        config = fit_world(config, dist.get_world_size())
    errors = BoostConfig.validate(config)  # the core only: this model is checked against the degrees itself
    if errors:
        raise ValueError("; ".join(errors))
    p = config.parallel
    topology = p.topology()
    deferred = copy.deepcopy(model) if has_deferred(model) else None  # as meta, before anything converts it
    renames = hf_renames(model)  # transformers' own loading renames, of the model as the user built it
    group_of, conversion = _own_experts(model, groups_by_name(model, optimizer), topology.ep)
    if conversion.blocks:  # adapters carried into the converted layers: known by their new names
        adapters = dataclasses.replace(adapters, converted=converted_adapters(model))
    check_experts(model, topology.ep)  # before anything else changes the model
    spec = spec if spec is not None else model_spec(model)
    _check_refusals(model, spec, p)
    tp_plan = None
    if topology.tp > 1:  # resolved on the serial model: the MoE layers' styles are checked before any group
        roles = (spec if plan is None else ModelSpec(roles=plan)).plan(
            topology.tp_mode,
            model,
            depth=topology.tp_depth,
            adjust=None if topology.tp_mode.whole_rows else (lambda roles: split_mixtures(roles, model)),
        )
        tp_plan = resolve(model, roles, tp=topology.tp, sequence_parallel=p.sequence_parallel)
        check_moe_plan(model, tp_plan.assignments, sequence_parallel=p.sequence_parallel)
    buffers = persistent_buffers(model)
    fp32 = kept_in_fp32(
        model,
        [*(n for n, _ in model.named_parameters()), *buffers],
        conversion.exported,
        compute_dtype(config.train.precision),
    )
    return _Job(
        config=config,
        topology=topology,
        spec=spec,
        plan=plan,
        tp_plan=tp_plan,
        group_of=group_of,
        full_shapes={name: tuple(param.shape) for name, param in model.named_parameters()},
        aliases=tied_aliases(model),
        exported=conversion.exported,
        deferred=deferred,
        buffer_shapes={name: tuple(b.shape) for name, b in buffers.items()},
        adapters=adapters,
        renames=renames,
        fp32=fp32,
    )


def _own_experts(model: nn.Module, group_of: dict[str, int], ep: int) -> tuple[dict[str, int], Conversion]:
    """Step 1's first change: the model's Hugging Face sparse MoE blocks
    (`tessera.launcher.families.hf_moe`), then a user's own mixture-of-experts blocks
    (`tessera.launcher.families.own_moe`), become ``tessera.moe.MoE`` layers, which
    ``parallel.ep`` can split, at every ep so that the trained names do not depend on it; blocks
    that do not convert are refused at ep > 1 and left as they are at ep = 1 (they train as
    written; each kind converts all its blocks or none). Returns the optimizer groups by the
    names trained from now on, and the conversion (the HF or user's names for export)."""
    conversion = Conversion()
    for convert in (hf_moe_conversion, convert_own_moe):
        try:
            done = convert(model, group_of)
        except ValueError as e:
            if ep > 1:
                raise
            log.info("mixture-of-experts blocks left as written (ep = 1): %s", e)
            continue
        converted = tuple(f"{block}." for block in done.blocks)
        group_of = {**{n: g for n, g in group_of.items() if not n.startswith(converted)}, **done.groups}
        conversion.exported.update(done.exported)
        conversion.groups.update(done.groups)
        conversion.blocks += done.blocks
    return group_of, conversion


def _mesh(job: _Job) -> Mesh:
    """Step 2: the groups of every axis (dp x cp together under context parallelism)."""
    return Mesh(job.topology, combined=[("dp", "cp")] if job.topology.cp > 1 else [])


def _serial_references(
    model: nn.Module, job: _Job, verify: bool | Literal["twin"], example: Tensor | None
) -> tuple[Verifier | None, nn.Module | None]:
    """Step 3: the verifier (its serial copy) and under pp the blocks checked to reproduce the
    model's logits, before tensor parallelism changes the model; with a deferred model, its
    meta copy as the user built it (taken in step 1, before its own mixtures were converted)."""
    config, spec, p = job.config, job.spec, job.config.parallel
    if verify == "twin":
        _verify_on_twin(model, config, spec=spec, plan=job.plan)
        verify = False
    verifier = Verifier(model, config, loss=spec.loss, output=spec.output) if verify else None
    serial = job.deferred
    if p.pp > 1:
        blocks = pipeline_blocks(model, spec)
        if len(blocks) < p.pp * p.virtual_stages:
            raise ValueError(
                f"{type(model).__name__} has {len(blocks)} pipeline blocks, fewer than parallel.pp * "
                f"parallel.virtual_stages = {p.pp} * {p.virtual_stages}"
            )
        check_blocks(model, blocks, example_ids(model, example), spec.output)
    return verifier, serial


def _parallelize(
    model: nn.Module, job: _Job, mesh: Mesh, example: Tensor | None
) -> dict[str, tuple[int, int]]:
    """Step 4: this rank's experts (ep), tensor parallelism by the resolved plan, context
    parallelism (no cores named: its ``F.scaled_dot_product_attention`` calls are found and
    routed). Returns the expert slices this rank holds (`expert_slices`)."""
    p, spec = job.config.parallel, job.spec
    shard_moe(model, mesh)  # ep > 1: this rank's experts (ZeRO shards them over edp: expert_sharding)
    experts = expert_slices(model)
    if job.tp_plan is not None:
        parallelize(
            model,
            plan=job.tp_plan,
            mesh=mesh,
            sequence_parallel=p.sequence_parallel,
            seed=job.config.train.seed,
        )
    if mesh.size("cp") > 1:
        tp = mesh.size("tp")
        context_parallelize(
            model,
            mesh.group("cp"),
            mode=p.cp_mode,
            layout=p.cp_layout,
            cores=spec.attention_cores,
            positions=spec.positions or _position_roles(job.plan if job.plan is not None else spec.roles),
            probe=_sequence_probe(model, example, tp=tp if p.sequence_parallel else 1),
        )
    return experts


def _partition(model: nn.Module, job: _Job, mesh: Mesh) -> _Pipeline | None:
    """Step 5: the cut, once (tensor parallelism replaced modules, so the blocks are found
    again); several stages per rank balance what each rank holds, not only each stage."""
    p = job.config.parallel
    if p.pp == 1:
        return None
    blocks = pipeline_blocks(model, job.spec)
    schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    partition = partition_by_params(blocks, schedule=schedule)
    return _Pipeline(blocks, schedule, partition, stage_modules(blocks, partition, mesh.coordinate("pp")))


def _wrap_layers(model: nn.Module, job: _Job) -> None:
    """Step 6: each layer of the layer stack compiled (innermost: checkpointing's recomputation
    replays its random streams eagerly), then offloaded, then checkpointed, as configured."""
    t = job.config.train
    if not (t.activation_checkpointing or t.activation_offload or t.compile):
        return
    stack = job.spec.blocks if isinstance(job.spec.blocks, str) else layer_stack(model)
    layers = list(model.get_submodule(stack).children())
    if t.compile:
        compile_layers(layers)
    if t.activation_offload:
        offload_layers(layers)
    if t.activation_checkpointing:
        checkpoint_layers(layers, every=t.recompute_every, policy=t.recompute_policy)


def _place(
    model: nn.Module, job: _Job, mesh: Mesh, pipe: _Pipeline | None, experts: dict[str, tuple[int, int]]
) -> tuple[nn.Module, Placement, list[tuple[str, nn.Parameter, bool]]]:
    """Step 7: the module this rank trains (its stages under pp), where each parameter it holds
    sits in the serial model, and the weights tied across pipeline ranks (each holder keeps a
    copy; their gradients are summed every step, norms count them once)."""
    tp = mesh.size("tp")
    specs = dict(shard_specs(model))
    named = dict(model.named_parameters())
    names = {id(param): name for name, param in named.items()}
    # how many tp ranks hold each element: tp for a parameter no style split, else what its
    # spec says (1 for a partition, the depth for 2.5D's depth replicas, ...)
    copies = {param: specs[name].replicas(tp) if name in specs else tp for name, param in named.items()}
    stage_to_rank: tuple[int, ...] = ()
    tied: list[tuple[str, nn.Parameter]] = []
    module: nn.Module = model
    if pipe is not None:
        module = nn.ModuleDict({str(s): m for s, m in pipe.stages.items()})
        stage_to_rank = pipe.schedule.stage_to_rank
        for param, where in tied_blocks(pipe.blocks).items():
            holders = {pipe.partition.rank_of_block(b) for b in where}
            if len(holders) > 1:
                tied.append((names[id(param)], param))
                copies[param] *= len(holders)
        tied.sort(key=lambda item: item[0])
    local = list(module.parameters())
    local_ids = {id(param) for param in local}
    if pipe is not None:
        release_others(named.values(), local_ids)
    serial_buffers = {id(b): name for name, b in persistent_buffers(model).items()}
    buffers = {  # held whole (a buffer a tp style split would not be the serial one)
        local: serial_buffers[id(b)]
        for local, b in persistent_buffers(module).items()
        if id(b) in serial_buffers and tuple(b.shape) == job.buffer_shapes.get(serial_buffers[id(b)])
    }
    placement = Placement(
        names={param: names[id(param)] for param in local},
        full_shapes=job.full_shapes,
        replicated={param: n for param, n in copies.items() if n > 1 and id(param) in local_ids},
        shard_specs=specs,
        stage_to_rank=stage_to_rank,
        experts=experts,
        aliases=job.aliases,
        exported=job.exported,
        buffers=buffers,
        adapters=job.adapters,
        renames=job.renames,
    )
    return module, placement, [(name, param, id(param) in local_ids) for name, param in tied]


def _zero(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    job: _Job,
    mesh: Mesh,
    placement: Placement,
    values: DeferredValues | None,
) -> ZeroOptimizer:
    """Step 8: the user's optimizer rebuilt over this rank's parameters, sharded by ZeRO over
    the data-parallel ranks (a deferred model's parameters made as its flat buffers fill)."""
    config, cp = job.config, mesh.size("cp")
    tp, pp = mesh.size("tp"), mesh.size("pp")
    local = {placement.names[p]: p for p in module.parameters()}
    held = persistent_buffers(module).items()
    keep = [p for n, p in local.items() if n in job.fp32] + [
        b for n, b in held if placement.buffers.get(n) in job.fp32
    ]
    if keep:
        log.info("computed in fp32 (as transformers keeps them): %d parameters and buffers", len(keep))
    zero = ZeroOptimizer(
        module,
        rebuild_optimizer(optimizer, local, job.group_of),
        stage=config.zero.stage,
        group=mesh.group(("dp", "cp")) if cp > 1 else mesh.group("dp"),
        average_over=mesh.size("dp"),
        precision=config.train.precision,
        offload=config.zero.offload,
        clip_grad_norm=config.optim.clip_grad_norm if config.optim.clip_grad_norm > 0 else None,
        norm_groups=[g for g, n in ((mesh.group("tp"), tp), (mesh.group("pp"), pp)) if n > 1],
        replication=placement.replicated,
        memory=chunk_config(config, mesh.rank),
        sharding=expert_sharding(module, mesh),
        init=values,
        device=mesh.device,
        keep_fp32=keep,
    )
    if values is not None:
        log.info("deferred initialization: this rank made %d parameter elements", values.made)
    return zero


def _engine(
    job: _Job,
    mesh: Mesh,
    module: nn.Module,
    zero: ZeroOptimizer,
    pipe: _Pipeline | None,
    placement: Placement,
    tied: list[tuple[str, nn.Parameter, bool]],
    verifier: Verifier | None,
    scheduler_fn: Any,
    held: int,
) -> Engine:
    """Step 9: the mode's objective (what each rank trains on, its exact loss), the loss each
    microbatch trains on (scaled by the engine per step), the pipeline runtime, the Engine."""
    config, p = job.config, job.config.parallel
    goal = objective(mesh, cp_layout=p.cp_layout, loss=job.spec.loss)
    step_loss = StepLoss(goal)
    runtime = None
    if pipe is not None:
        runtime = PipelineRuntime(
            pipe.schedule,
            pipe.stages,
            step_loss,
            group=mesh.group("pp"),
            device=mesh.device,
            tune_splits=p.tune_splits,
        )
    log.info(
        "boosted: %s, zero stage %d, %s; this rank holds %d parameters",
        mesh.topology.describe(),
        config.zero.stage,
        config.train.precision,
        held,
    )
    return Engine(
        config=config,
        mesh=mesh,
        module=module,
        zero=zero,
        runtime=runtime,
        scheduler=scheduler_fn(zero.optimizer) if scheduler_fn is not None else None,
        objective=goal,
        output=job.spec.output,
        placement=placement,
        tied=tied,
        max_skipped_steps=config.train.max_skipped_steps,
        verifier=verifier,
        step_loss=step_loss,
    )


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
    default: the spec registered for the model's family or class, else one derived from its
    module tree. ``plan``: the tensor-parallel plan, overriding the spec's. ``example``: a batch of
    inputs; with pipelining, the blocks are first checked to reproduce ``model(example)``;
    under context parallelism its ids give the vocabulary of the sequence-split probe
    (``tessera.tensor_parallel.probe_sequence_split``, run before training on every cp rank).
    ``scheduler_fn(optimizer) -> LRScheduler`` builds the learning-rate schedule on the
    rebuilt optimizer (none by default). ``verify``: compare the first step with a serial step
    of the same model and refuse to train on a mismatch (None: ``train.verify``; see
    ``tessera.launcher.train.verify``; ``"twin"``: verify the same layout on a shrunken twin of a
    Hugging Face model first, then train the model itself unverified: ``tessera.launcher.train.twin``).
    A model built by ``deferred_parameters`` (parameters on the meta device) is materialized
    here, each rank only what it holds, one ZeRO flat buffer at a time (``deferred``), by
    ``init(name, module)`` (default ``deferred.default_init``) seeded by ``train.seed``.
    ``compile``: torch.compile each layer of the layer stack on its own, inside checkpointing
    and offload (None: ``train.compile``; see ``tessera.launcher.train.compiling``).
    """
    if compile is not None:  # it stands for train.compile, and is validated as that
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, compile=compile))
    configs = peft_config_of(model)
    model = unwrap_peft(model)  # a PEFT model trains as its base model with the adapters in place
    job = _checked(model, optimizer, config, spec, plan, read_adapters(model, configs))
    mesh = _mesh(job)
    check_same_start(model, mesh.device)  # every rank splits the same model
    verifier, serial = _serial_references(
        model, job, config.train.verify if verify is None else verify, example
    )
    experts = _parallelize(model, job, mesh, example)
    pipe = _partition(model, job, mesh)
    values = (  # deferred: ZeRO makes this rank's parameters as it fills its flat buffers, as eager ones
        None
        if serial is None
        else DeferredValues(
            serial,
            model,
            seed=config.train.seed,
            init=init,
            tp_rank=mesh.coordinate("tp"),
            tp=mesh.size("tp"),
            experts=experts,
            exported=job.exported,
        )
    )
    _wrap_layers(model, job)
    module, placement, tied = _place(model, job, mesh, pipe, experts)
    held = sum(param.numel() for param in module.parameters())  # before ZeRO flattens them
    zero = _zero(module, optimizer, job, mesh, placement, values)
    return _engine(job, mesh, module, zero, pipe, placement, tied, verifier, scheduler_fn, held)
