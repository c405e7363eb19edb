"""Split one stage's backward into B (input gradient) and W (weight gradients) for zero-bubble.

A stage computed ``y = stage(x)``. Its autograd graph has two kinds of work: the chain that
carries the gradient from ``y`` to ``x`` (the *input path*: only this is on the pipeline's
critical path, because the previous stage waits for it) and the branches that leave that
path towards the parameters (weight gradients, which can run whenever the rank would idle).

`backward_input` (B) runs autograd from ``y`` to ``x`` only. Before it runs, it finds, for
every parameter, the first nodes of the input path its branch hangs off (the *frontier*,
e.g. the matmul node whose output gradient both ``dx`` and ``dW`` need) and asks autograd,
in the same call that computes ``dx``, for the gradient flowing into each of them (an edge
into a node as an input of ``torch.autograd.grad``), which it keeps. `WeightGrad.run` (W)
later restarts autograd at those
frontier nodes with the kept gradients and asks for the parameters only, so no node of the
input path is computed twice except the frontier nodes' weight outputs, which B skipped.
Parameters whose frontiers share nodes form one group, computed in one autograd call; when
a group has several frontier nodes, each one is clamped to its kept gradient so a path from
one to another cannot count twice. (The same idea as torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``.)

**Fixed costs.** W makes one engine call per group (dozens per microbatch), so it calls the
engine's own entry (``torch.autograd.graph._engine_run_backward``) instead of
``torch.autograd.backward``, whose Python checks cost about a tenth of a small stage's W;
B reads the number of gradients a node receives from ``Node._input_metadata`` to name the
edges it keeps (no Python hook runs inside the engine). Both are private torch details:
without them the public calls (and pre-hooks on the frontier nodes) do the same.

Results equal one full backward to fp32 round-off: the same node functions run on the same
gradients, only in two calls.

A stage without a differentiable input (the first stage reads token ids) has no input path:
B then does nothing and W runs the whole backward (nothing waits for that stage's B).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrad", "backward_full", "backward_input", "grad_nodes"]

_Grads = tuple[Tensor | None, ...]


@dataclass(eq=False)
class _Group:
    params: list[Tensor] = field(default_factory=list)
    frontier: list[Node] = field(default_factory=list)
    grads: dict[Node, _Grads] = field(default_factory=dict)


@dataclass(eq=False)
class WeightGrad:
    """The deferred W of one (microbatch, stage): call `run` once to accumulate ``param.grad``."""

    output: Tensor | None
    grad_output: Tensor | None
    params: list[Tensor]
    groups: list[_Group]
    full: bool

    def run(self) -> None:
        """Compute the weight gradients and add them to each parameter's ``.grad``."""
        if self.full:
            if self.output is not None:
                backward_full(self.output, self.grad_output)
        else:
            for i, group in enumerate(self.groups):
                _run_group(group, retain=i < len(self.groups) - 1)
        self.output = self.grad_output = None
        self.groups = []


def _run_group(group: _Group, *, retain: bool) -> None:
    edges: list[GradientEdge] = []
    grads: list[Tensor] = []
    for node in group.frontier:
        for i, g in enumerate(group.grads.get(node, ())):
            if g is not None:
                edges.append(GradientEdge(node, i))
                grads.append(g)
    if not edges:
        return
    handles = []
    if len(group.frontier) > 1:  # a path from one frontier node to another must not count twice
        for node in group.frontier:
            kept = group.grads.get(node)
            if kept is not None:
                handles.append(node.register_prehook(lambda _g, kept=kept: kept))
    try:  # the engine adds the weight gradients to .grad itself
        _accumulate(edges, grads, group.params, retain)
    finally:
        for h in handles:
            h.remove()


def _accumulate(edges: list[GradientEdge], grads: list[Tensor], params: list[Tensor], retain: bool) -> None:
    """``torch.autograd.backward(edges, grads, inputs=params)`` without its Python checks.

    W calls the engine once per group (dozens per microbatch); the public wrapper re-validates
    every gradient's shape in Python each time (about a tenth of a small stage's W). The
    gradients given here are the ones autograd itself handed to the frontier nodes during B,
    so they are valid by construction. Falls back to the public call if torch moves the entry.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:  # pragma: no cover - depends on torch internals
        torch.autograd.backward(edges, grads, retain_graph=retain, inputs=params)
        return
    # (roots, grads, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
    run(tuple(edges), tuple(grads), retain, False, tuple(params), True, True)


def backward_full(output: Tensor, grad_output: Tensor | None) -> None:
    """One unsplit backward of ``output`` (a loss when ``grad_output`` is None) into ``.grad``;
    nothing when no gradient flows back from it (the first stage holding only frozen
    parameters: as in the serial model, autograd never reaches them)."""
    if output.requires_grad:
        torch.autograd.backward(output, grad_output)


def _parents(root: Node) -> dict[Node, list[Node]]:
    """For every node reachable from ``root``, the nodes that feed gradient into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = {root}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            parents[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return parents


def _upwards(
    starts: Iterable[Node], parents: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reached going from ``starts`` towards the output, and the ``stop`` nodes met."""
    seen: set[Node] = set()
    met: set[Node] = set()
    queue = deque(starts)
    while queue:
        node = queue.popleft()
        for parent in parents.get(node, ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def grad_nodes(params: Sequence[Tensor]) -> list[Node]:
    """The gradient accumulator node of each parameter (creating it; holding it keeps it)."""
    return [get_gradient_edge(p).node for p in params]


def _analyse(
    root: Node, input_node: Node, trainable: list[Tensor], nodes: Sequence[Node]
) -> list[_Group] | None:
    """The parameter groups and their frontiers; None if the output ignores the input."""
    parents = _parents(root)
    if input_node not in parents:
        return None
    on_path, _ = _upwards([input_node], parents, set())  # nodes that carry d(output)/d(input)
    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    for param, node in zip(trainable, nodes, strict=True):
        if node not in parents:
            continue  # unused by this stage: no gradient, as in the serial model
        _, frontier = _upwards([node], parents, on_path)
        merged = {id(group_of[n]): group_of[n] for n in frontier if n in group_of}
        group = _Group()
        for old in merged.values():
            group.params += old.params
            group.frontier += [n for n in old.frontier if n not in group.frontier]
            groups.remove(old)
        group.params.append(param)
        group.frontier += [n for n in frontier if n not in group.frontier]
        for n in group.frontier:
            group_of[n] = group
        groups.append(group)
    return groups


def backward_input(
    output: Tensor,
    grad_output: Tensor | None,
    inp: Tensor | None,
    params: Sequence[Tensor],
    nodes: Sequence[Node] | None = None,
) -> tuple[Tensor | None, WeightGrad]:
    """B: the gradient of ``inp`` (None without one) and the deferred W for ``params``.

    ``output`` is the stage output (or the scaled loss, when ``grad_output`` is None); the
    graph is kept alive until the returned `WeightGrad` runs. ``nodes`` are `grad_nodes` of
    ``params`` (saves looking them up for every microbatch); all params must require grad.
    """
    trainable = list(params)
    root = output.grad_fn
    if inp is None or not inp.requires_grad or root is None:
        return None, WeightGrad(output, grad_output, trainable, [], full=True)
    input_edge = get_gradient_edge(inp)
    input_node = input_edge.node
    nodes = grad_nodes(trainable) if nodes is None else nodes
    groups = _analyse(root, input_node, trainable, nodes)
    if groups is None:  # the output does not depend on the input
        return torch.zeros_like(inp), WeightGrad(output, grad_output, trainable, [], full=True)
    slots = [(group, node, _num_slots(node)) for group in groups for node in group.frontier]
    if any(k is None for _, _, k in slots):  # torch hides the count: keep them with pre-hooks
        return _backward_input_hooked(output, grad_output, inp, trainable, groups)
    # B asks autograd for the input gradient and, in the same call, for the gradients that
    # reach each frontier node (an edge into a node names the gradient of its output)
    edges = [GradientEdge(node, i) for _, node, k in slots for i in range(k or 0)]
    found = torch.autograd.grad(
        output, [input_edge, *edges], grad_output, retain_graph=True, allow_unused=True
    )
    at = 1
    for group, node, k in slots:
        group.grads[node] = tuple(found[at : at + (k or 0)])
        at += k or 0
    return found[0], WeightGrad(None, None, trainable, groups, full=False)


def _num_slots(node: Node) -> int | None:
    """How many gradients flow into ``node`` (its forward's outputs); None if torch hides it."""
    metadata = getattr(node, "_input_metadata", None)
    return None if metadata is None else len(metadata)


def _backward_input_hooked(
    output: Tensor, grad_output: Tensor | None, inp: Tensor, trainable: list[Tensor], groups: list[_Group]
) -> tuple[Tensor | None, WeightGrad]:
    """B keeping the frontier gradients with pre-hooks (for a torch without ``_input_metadata``)."""
    handles = []
    for group in groups:
        for node in group.frontier:

            def keep(grads: _Grads, node: Node = node, group: _Group = group) -> None:
                group.grads[node] = tuple(grads)

            handles.append(node.register_prehook(keep))
    try:
        (dx,) = torch.autograd.grad(output, [inp], grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, WeightGrad(None, None, trainable, groups, full=False)
