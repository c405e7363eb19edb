"""What a search shows: a table of the best candidates with memory and time broken down, a
summary paragraph, and a PNG of predicted memory against step time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tessera.planner.cluster import GIB, Cluster
from tessera.planner.experts import ExpertShape
from tessera.planner.model import ModelShape
from tessera.planner.search import Candidate, SearchResult

__all__ = ["summary", "table", "write_png"]

COLUMNS = (
    "#",
    "configuration",
    "step s",
    "bubble",
    "tok/s",
    "TFLOP/s/dev",
    "memory",
    "params",
    "grads",
    "optim",
    "host",
    "acts",
    "compute s",
    "tp/cp s",
    "bubble s",
    "dp s",
    "opt s",
    "crowd s",
)


def _row(i: int, c: Candidate, model: ModelShape, world: int) -> list[str]:
    m, t = c.estimate.memory, c.estimate.time

    def gib(x: float) -> str:
        for unit, scale in (("G", GIB), ("M", 2**20), ("K", 2**10)):
            if x >= scale:
                return f"{x / scale:.3g}{unit}"
        return f"{x:.0f}"

    return [
        str(i),
        c.label(),
        f"{t.total:.4g}",
        f"{c.estimate.bubble_fraction:.0%}",
        f"{model.batch * model.seq / t.total:.4g}",
        f"{model.step_flops() / t.total / world / 1e12:.3g}",
        gib(m.device),
        gib(m.parameters),
        gib(m.gradients),
        gib(m.optimizer_state),
        gib(m.host),
        gib(m.activations),
        f"{t.compute:.3g}",
        f"{t.tensor_comm:.3g}",
        f"{t.bubble:.3g}",
        f"{t.data_comm:.3g}",
        f"{t.optimizer:.3g}",
        f"{t.crowding:.3g}",
    ]


def table(candidates: Sequence[Candidate], model: ModelShape, world: int) -> str:
    """A fixed-width table of ``candidates`` in order: memory of the fullest rank in bytes
    (K/M/G: binary units) and its parts, seconds per step and their parts (compute includes
    the tensor/context-parallel communication it waits for, shown again as tp/cp s; crowd s:
    what ranks sharing a CPU host's cores add, `StepTime.crowding`)."""
    rows = [list(COLUMNS), *(_row(i + 1, c, model, world) for i, c in enumerate(candidates))]
    widths = [max(len(r[k]) for r in rows) for k in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def summary(
    result: SearchResult, model: ModelShape, cluster: Cluster, world: int, moe: ExpertShape | None = None
) -> str:
    """One paragraph: the model (``moe``: with its mixtures of experts), the cluster, what was
    searched and what was found."""
    params, experts = model.params, ""
    if moe is not None:  # the experts, routers and shared experts in place of those layers' MLPs
        d, f, b = model.hidden, model.ffn, int(model.bias)
        params += moe.layers * (
            moe.experts * moe.expert_params(d) + moe.dense_params(d) - (2 * d * f + b * (f + d))
        )
        experts = f", {moe.experts} experts top-{moe.top_k} in {moe.layers} layers"
    return (
        f"model: {model.layers} layers, hidden {model.hidden}, {model.heads} heads, vocab {model.vocab}, "
        f"seq {model.seq}, batch {model.batch}{experts} ({params / 1e6:.4g}M parameters)\n"
        f"cluster: {cluster.name}, {world} devices of {cluster.memory_gib:g} GiB "
        f"({cluster.devices_per_node} per node)\n"
        f"searched: {result.layouts} layouts examined, {len(result.ranked)} fit, "
        f"{len(result.too_big)} too big, "
        f"{result.overflow} could not fit at any ZeRO stage, {result.invalid} refused by validation, "
        f"{result.pruned} degree splits pruned"
    )


def write_png(result: SearchResult, cluster: Cluster, path: str | Path, *, top: int = 10) -> None:
    """Scatter predicted device memory against step time for every evaluated candidate
    (those that fit, and those that do not), the device's memory as a line, the top marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for group, colour, label in ((result.too_big, "tab:red", "too big"), (result.ranked, "tab:blue", "fits")):
        if group:
            ax.scatter(
                [c.step_time for c in group],
                [c.estimate.memory.device / GIB for c in group],
                s=8,
                alpha=0.5,
                color=colour,
                label=f"{label} ({len(group)})",
            )
    best = result.ranked[:top]
    if best:
        ax.scatter(
            [c.step_time for c in best],
            [c.estimate.memory.device / GIB for c in best],
            s=30,
            color="black",
            marker="x",
            label=f"top {len(best)}",
        )
    ax.axhline(cluster.memory_gib, color="grey", linestyle="--", label="device memory")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("predicted memory of the fullest rank (GiB)")
    ax.set_title(f"tessera plan: {cluster.name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
