"""Adapters out of a boosted model: PEFT's adapter files, and an export with them merged.

``save_adapter`` writes what ``PeftModel.save_pretrained`` writes, so that
``PeftModel.from_pretrained(base_model, directory)`` loads it: ``adapter_config.json`` (the
adapter's configuration as the user gave it to PEFT, ``inference_mode`` set) and
``adapter_model.safetensors`` holding every ``lora_*`` parameter under PEFT's key
(``base_model.model.`` + the serial name without the adapter's name:
``...q_proj.lora_A.weight``), in fp32; an adapter other than ``default`` goes in a folder of its
own name, as PEFT puts it. The adapters are a small part of the model: their full values
are gathered (over tp, and from every pipeline stage to rank 0) as ZeRO streams the masters
one trained flat buffer at a time (``iter_full_state(trained_only=True)``): the frozen base is
not even gathered.

``export_merged`` writes the model a plain ``transformers`` class loads: each adapted layer's
weight ``W + sum_k scaling_k * B_k @ A_k`` (transposed for a Conv1D base) under the base
layer's own name (``q_proj.weight``, not ``q_proj.base_layer.weight``), the adapters left out,
streamed like ``export``. A layer trained whole as a copy (PEFT's ``modules_to_save``) is in the
adapter files under its plain name, and in the merged model as its (first adapter's) copy.
An adapter carried into a converted mixture goes into the files under the key of the PEFT
module it came from (``experts.base_layer.lora_A.weight``, in PEFT's stacked layout), and into
the merged model added to the experts' stacked weights (or the router's), which the export
holds under the converted names (``hf_moe_state_dict`` maps them to transformers').
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor

from tessera.comm.blobs import all_gather_bytes
from tessera.comm.consensus import raise_together
from tessera.comm.files import atomic_write
from tessera.launcher.checkpoint.adapted import Adapters, is_adapter_parameter
from tessera.launcher.checkpoint.consolidate import (
    MAX_SHARD_BYTES,
    export_sharded,
    full_tensor,
    streamed_names,
)
from tessera.launcher.checkpoint.exported import ExportPart, ExportView, parts_of
from tessera.launcher.checkpoint.placement import Boosted
from tessera.launcher.families.adapters import PEFT_PREFIX
from tessera.launcher.families.hf_moe_adapters import to_peft

__all__ = ["adapter_tensors", "export_merged", "peft_key", "save_adapter"]


def adapter_tensors(engine: Boosted) -> dict[str, Tensor]:
    """The full fp32 value of every adapter parameter of this rank's pipeline stages, by serial
    name, on the host. Collective over every rank of the stage (ZeRO streams the trained flat
    buffers; the frozen base is not gathered)."""
    names = streamed_names(engine, trained_only=True)
    device, adapters = engine.mesh.device, engine.placement.adapters
    out = {}
    for i, (_, value) in enumerate(engine.zero.iter_full_state(params_only=True, trained_only=True)):
        if adapters.trains_apart(names[i]):  # the same names on every rank of the stage
            out[names[i]] = full_tensor(engine, names[i], value.to(device)).to("cpu", torch.float32)
    return out


def _every_stage(engine: Boosted, local: dict[str, Tensor]) -> dict[str, Tensor]:
    """``local`` merged with every other pipeline rank's (collective over pp)."""
    if engine.mesh.size("pp") == 1:
        return local
    blobs = all_gather_bytes(safetensors.torch.save(local) if local else b"", engine.mesh.group("pp"))
    merged: dict[str, Tensor] = {}
    for blob in blobs:
        merged.update(safetensors.torch.load(blob) if blob else {})
    return merged


def peft_key(name: str, adapter: str, adapters: Adapters | None = None) -> str | None:
    """The key PEFT saves serial parameter ``name`` under for ``adapter`` (None: not that
    adapter's): ``base_model.model.`` + the name without the adapter's own component; a trained
    copy (``modules_to_save``) under its layer's plain name."""
    copy = None if adapters is None else adapters.copy_of(name)
    if copy is not None:
        layer, owner, rest = copy
        return f"{PEFT_PREFIX}{layer}.{rest}" if owner == adapter else None
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_") and parts[i + 1] == adapter:
            return PEFT_PREFIX + ".".join(parts[: i + 1] + parts[i + 2 :])
    return None


def save_adapter(engine: Boosted, directory: str | Path) -> Path:
    """Write every adapter of a boosted PEFT model to ``directory`` in PEFT's format (see the
    module docstring); returns ``directory``. ValueError (before anything is gathered) for a
    model that came without PEFT's configuration. Collective over every rank; rank 0 writes."""
    directory = Path(directory)
    adapters = engine.placement.adapters
    if not adapters.configs:
        raise ValueError(
            "save_adapter: this model was not boosted as a PEFT model (peft.get_peft_model(...)), so "
            "there is no adapter configuration to write; export() writes the whole model"
        )
    tensors = _every_stage(engine, adapter_tensors(engine))
    error: BaseException | None = None
    if engine.mesh.rank == 0:
        try:
            for adapter, config in adapters.configs.items():
                target = directory if adapter == "default" else directory / adapter
                keyed = {
                    k: v for n, v in tensors.items() if (k := peft_key(n, adapter, adapters)) is not None
                }
                keyed.update(_converted_files(adapters, tensors, adapter))
                if not keyed:
                    raise ValueError(f"save_adapter: no parameters of adapter {adapter!r} were trained")
                target.mkdir(parents=True, exist_ok=True)
                body = safetensors.torch.save(dict(sorted(keyed.items())), metadata={"format": "pt"})
                atomic_write(target / "adapter_model.safetensors", body)
                text = json.dumps({**config, "inference_mode": True}, indent=2, sort_keys=True, default=str)
                atomic_write(target / "adapter_config.json", text.encode())
        except (OSError, ValueError) as e:
            error = e
    raise_together(error, None, f"writing the adapters to {directory}", engine.mesh.device)
    return directory


def _factors(
    module: str, weights: tuple[str, ...], tensors: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    ups = {w: tensors[f"{module}.up" if w == "up" else f"{module}.up.{w}"] for w in weights}
    return tensors[f"{module}.down"], ups


def _converted_files(adapters: Adapters, tensors: dict[str, Tensor], adapter: str) -> dict[str, Tensor]:
    """Adapter ``adapter``'s converted mixture adapters under PEFT's keys."""
    out = {}
    for module, found in adapters.converted.items():
        if found.adapter != adapter or f"{module}.down" not in tensors:
            continue
        pairs = to_peft(found.kind, *_factors(module, found.weights, tensors))
        for source, (a, b) in zip(found.sources, pairs, strict=True):
            out[f"{PEFT_PREFIX}{source}.lora_A.weight"] = a.contiguous()
            out[f"{PEFT_PREFIX}{source}.lora_B.weight"] = b.contiguous()
    return out


def _converted_deltas(adapters: Adapters, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the converted mixture adapters add to the weights they change, by serial name."""
    out: dict[str, Tensor] = {}
    for module, found in adapters.converted.items():
        if f"{module}.down" not in tensors:
            continue  # another pipeline stage's
        down, ups = _factors(module, found.weights, tensors)
        bank = module.partition(".adapters.")[0]
        for w, up in ups.items():
            if w == "up":
                target, delta = f"{bank}.weight", up @ down
            else:
                target, delta = f"{bank}.{w}", (up @ down).transpose(1, 2)
            out[target] = out[target] + delta * found.scaling if target in out else delta * found.scaling
    return out


def _merged_view(engine: Boosted) -> ExportView:
    """Each adapted layer's base weight under its own name with the adapters' product added;
    the adapters' own parameters left out (this rank's stages)."""
    adapters, placement = engine.placement.adapters, engine.placement
    tensors = adapter_tensors(engine)
    exported = dict(placement.exported)
    added: dict[str, Tensor] = {}
    first = {layer: names[0] for layer, names in adapters.copies.items() if names}
    added.update(_converted_deltas(adapters, tensors))
    for name in placement.full_shapes:
        if adapters.converted_of(name) is not None:
            exported[name] = ()
            continue
        if name in added:  # a converted bank: its parts under the plain layers' names
            plain_parts = (
                ExportPart(p.name.replace(".base_layer.", "."), p.index, p.transpose)
                for p in parts_of(name, exported)
            )
            exported[name] = tuple(plain_parts)
            continue
        copy = adapters.copy_of(name)
        if copy is not None:  # the first adapter's trained copy stands for the layer; the rest go
            saved, copy_adapter, rest = copy
            exported[name] = (ExportPart(f"{saved}.{rest}"),) if copy_adapter == first.get(saved) else ()
            continue
        owner = adapters.owner(name)
        if owner is None:
            continue
        if is_adapter_parameter(name):
            exported[name] = ()
            continue
        plain = owner + name[len(owner) :].replace(".base_layer.", ".", 1)
        exported[name] = tuple(ExportPart(plain, p.index, p.transpose) for p in parts_of(name, exported))
        if name != f"{owner}.base_layer.weight":
            continue
        layer = adapters.layers[owner]
        delta = None
        for adapter, scale in layer.scaling.items():
            a, b = (
                tensors.get(f"{owner}.lora_A.{adapter}.weight"),
                tensors.get(f"{owner}.lora_B.{adapter}.weight"),
            )
            if a is None or b is None:
                continue  # held by another pipeline stage: so is the base weight
            term = (b @ a) * scale
            delta = term if delta is None else delta + term
        if delta is not None:
            added[name] = delta.t() if layer.transposed else delta
    return ExportView(exported, added)


def export_merged(
    engine: Boosted,
    directory: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """``export_sharded`` of the model with every adapter merged into its base layer (see the
    module docstring); collective; returns the index's path."""
    view = _merged_view(engine)
    return export_sharded(engine, directory, max_shard_bytes=max_shard_bytes, dtype=dtype, view=view)
