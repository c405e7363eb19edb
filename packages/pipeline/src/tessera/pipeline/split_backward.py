"""Split one stage's backward into B (input gradient) and W (weight gradients) for zero-bubble.

A stage computed ``y = stage(x)``. Its autograd graph has two kinds of work: the chain that
carries the gradient from ``y`` to ``x`` (the *input path*: only this is on the pipeline's
critical path, because the previous stage waits for it) and the branches that leave that
path towards the parameters (weight gradients, which can run whenever the rank would idle).

`backward_input` (B) runs autograd from ``y`` to ``x`` only. Before it runs, it finds, for
every parameter, the first nodes of the input path its branch hangs off (the *frontier*,
e.g. the matmul node whose output gradient both ``dx`` and ``dW`` need) and hooks them to
keep the gradient flowing into them. `WeightGrad.run` (W) later restarts autograd at those
frontier nodes with the kept gradients and asks for the parameters only, so no node of the
input path is computed twice except the frontier nodes' weight outputs, which B skipped.
Parameters whose frontiers share nodes form one group, computed in one autograd call; when
a group has several frontier nodes, each one is clamped to its kept gradient so a path from
one to another cannot count twice. (The same idea as torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``, written here against public autograd.)

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
        torch.autograd.backward(edges, grads, retain_graph=retain, inputs=group.params)
    finally:
        for h in handles:
            h.remove()


def backward_full(output: Tensor, grad_output: Tensor | None) -> None:
    """One unsplit backward of ``output`` (a loss when ``grad_output`` is None) into ``.grad``."""
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
    parents = _parents(root)
    input_node = get_gradient_edge(inp).node
    if input_node not in parents:  # the output does not depend on the input
        return torch.zeros_like(inp), WeightGrad(output, grad_output, trainable, [], full=True)
    on_path, _ = _upwards([input_node], parents, set())  # nodes that carry d(output)/d(input)
    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    for param, node in zip(trainable, grad_nodes(trainable) if nodes is None else nodes, strict=True):
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
