"""Stage 3's units: the modules whose parameters are gathered together, and who owns what.

A unit gathers the parameters it owns just before its forward (and its backward) and frees
them after. The model itself is always a unit and owns whatever no other unit does. A
parameter registered in several places (tied weights, a shared module) is owned by the
innermost unit that encloses every place it is used, so it is gathered for as long as any
user may need it; with GPT-style tied embeddings that is the model itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["assign_params", "default_units", "largest_module_list"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def largest_module_list(model: nn.Module) -> str | None:
    """The dotted name of the non-empty ``nn.ModuleList`` below ``model`` holding the most
    parameters (the shallowest of equals): the layer stack, wherever the model keeps it
    (``blocks``, ``layers``, ``model.layers``, ``transformer.h``); None without one."""
    sizes = {
        name: sum(p.numel() for p in module.parameters())
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and name
    }
    if not sizes:
        return None
    best: str = max(sizes, key=lambda n: (sizes[n], -n.count(".")))
    return best


def default_units(model: nn.Module) -> list[nn.Module]:
    """The children of ``model``, with the elements of container children (ModuleList,
    Sequential, ModuleDict) taken one by one; where the layer stack sits deeper
    (``largest_module_list``: ``model.layers`` in Hugging Face's causal LMs), the modules on
    the way to it are opened the same way, so each layer is a unit of its own. For the
    reference GPT: ``embed``, each layer, ``head``; for a Hugging Face Llama:
    ``model.embed_tokens``, each of ``model.layers``, ``model.norm``, ``model.rotary_emb``,
    ``lm_head``. Parameters owned directly by a module opened on the way belong to the model."""
    path = largest_module_list(model)
    return _opened(model, path.split(".")[:-1] if path else [])


def _opened(module: nn.Module, way: list[str]) -> list[nn.Module]:
    units: list[nn.Module] = []
    for name, child in module.named_children():
        if way and name == way[0]:
            units.extend(_opened(child, way[1:]))
        elif isinstance(child, _CONTAINERS):
            units.extend(child.children())
        else:
            units.append(child)
    return units


def _split(path: str) -> tuple[str, ...]:
    return tuple(path.split(".")) if path else ()


def assign_params(
    model: nn.Module, units: Sequence[nn.Module]
) -> list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Each unit (the model first, then ``units`` in order, duplicates dropped) with the
    ``(name, parameter)`` pairs it owns, in registration order; every parameter is owned once.

    Raises ValueError for a unit that is not a submodule of ``model``.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    by_id: dict[int, nn.Module] = {}
    for unit in [model, *units]:
        by_id.setdefault(id(unit), unit)
    unit_paths: dict[tuple[str, ...], int] = {}
    for path, module in modules.items():
        if id(module) in by_id:
            unit_paths[_split(path)] = id(module)
    missing = [type(u).__name__ for u in by_id.values() if u is not model and not _in(u, modules)]
    if missing:
        raise ValueError(f"stage-3 units must be submodules of the model; not found: {missing}")

    def owner_of(path: tuple[str, ...]) -> int:
        for cut in range(len(path), -1, -1):
            if path[:cut] in unit_paths:
                return unit_paths[path[:cut]]
        return id(model)

    places: dict[int, list[tuple[str, ...]]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = _split(name)
        places.setdefault(id(param), []).append(parts[:-1])
        first.setdefault(id(param), (name, param))
    owned: dict[int, list[tuple[str, nn.Parameter]]] = {uid: [] for uid in by_id}
    for pid, paths in places.items():
        owners = {owner_of(p) for p in paths}
        if len(owners) == 1:
            owner = owners.pop()
        else:
            common = paths[0]
            for p in paths[1:]:
                n = 0
                while n < min(len(common), len(p)) and common[n] == p[n]:
                    n += 1
                common = common[:n]
            owner = owner_of(common)
        owned[owner].append(first[pid])
    return [(by_id[uid], owned[uid]) for uid in by_id]


def _in(module: nn.Module, modules: dict[str, nn.Module]) -> bool:
    return any(m is module for m in modules.values())
