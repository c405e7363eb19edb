"""1D, 2D, 2.5D and 3D tensor parallelism side by side on gloo ranks: the reference GPT under
``GPT_PLAN`` (1D, Megatron), ``GPT_2D_PLAN`` (SUMMA), ``GPT_2P5D_PLAN`` (Tesseract) and
``GPT_3D_PLAN``, each through ``parallelize(model, plan=..., mesh=Mesh(Topology(tp=...,
tp_mode=..., tp_depth=...)))``, in one run:

- P=4 (a ``WorkerPool(4)``): 1D tp=4 and 2D q=2;
- P=8 (a ``WorkerPool(8)``): 1D tp=8, 2.5D q=2 d=2 and 3D q=2.

The peer of every mode is 1D at the same P (``ratio_vs_peer`` = 1D step time / this mode's,
above 1: faster than 1D; null on the 1D lines). All ranks are handed the same global batch
(1D: every rank runs all of it; 2D/2.5D/3D: the loss function takes this rank's block).
On this 2-core machine P ranks share 2 cores: the step times say how the code paths compare
under that contention, not what P devices would do.

Per mode:

- ``step_time_s``: median of ``--iters`` SGD steps (forward, backward, step) after
  ``--warmup``; a barrier before each step, the modes of one pool alternate step by step so
  background load hits them alike; the slower rank counts. ``tokens_per_s`` = batch * seq /
  step time (a token is one sequence position of the global batch).
- ``comm_bytes``: bytes moved per step per rank by ``tessera.comm.CommMeter`` (paper
  accounting: all-reduce of S = 2S, all-gather its output, reduce-scatter its input,
  broadcast its buffer), the largest over ranks; ``comm_by_op`` per kind of call (rank 0).
- ``formula_linear_bytes``: the README's per-layer formulas for the Linear layers of the
  transformer blocks (q, k, v, out_proj, fc_in, fc_out; forward + backward, summed over the
  layers). 1D: Megatron's f/g all-reduces, 8|Y| per block (Y = B*S*d fp32, the blocks'
  output; they belong to the attention and MLP regions, i.e. to these Linear layers);
  2D: 3(|X|+|W|)/q + 2|b|/q per Linear; 2.5D: 3(|X|/d+|W|)/q + 2|b|/q + 2(|W|+|b|)/q^2;
  3D: 2((|X|+|W|+|Y|)/q^2 + |b|(1/q+1/q^2)), |X|, |Y| its input and output over the global
  batch, |W|, |b| the serial weight and bias bytes. ``formula_bytes`` adds the other pieces
  with a formula: 1D the vocab embedding's all-reduce (2|Y|), the LM head's entry f (2|Y|)
  and the vocab-parallel loss's 3 fp32 per token all-reduced (24 B*S); 2D/2.5D/3D the
  LayerNorms (2L+1) and the hidden-split token and position embeddings. Not covered (so
  ``comm_bytes`` - ``formula_bytes`` = ``unaccounted_bytes`` is what they move): 2D/2.5D/3D
  the classifier (LM head) and the cross-entropy; ``formula_covers`` says which pieces.
- ``activation_bytes``: peak activation bytes per rank: storage bytes of the tensors
  autograd saves for backward during one forward (a ``saved_tensors_hooks`` pack hook,
  parameters excluded, each storage once by ``tessera.comm.storage_bytes``), the largest over
  ranks, as in ``benchmarks/cp.py``; op-internal transients are not counted. Beside it
  ``formula_activation_bytes``, the tensor_parallel README's activation formula of the mode
  (``activation_bytes_1d`` / ``_2d`` / ``_2p5d`` / ``_3d``: L blocks plus the embedding and
  head), and ``activation_vs_formula`` = measured / formula (1.0: exact).
- ``param_bytes``: storage bytes of the parameters a rank holds (largest over ranks), and
  ``param_ratio_vs_serial`` = that / the serial GPT's (1D keeps the LayerNorms, the position
  embedding and the row-parallel biases whole; 2.5D replicates weights over depth).
- ``loss_match``: the first step's loss equals the serial GPT's on the same batch (computed
  in the launching process) within rtol 1e-5 (``loss_diff`` gives the gap).

``--plot`` (default ``benchmarks/out/tp_nd.png``) writes a PNG of step time, bytes moved and
activation bytes per mode (matplotlib, Agg).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import emit, table
from torch import Tensor

from tessera.comm import CommMeter, Mesh, Topology, TPMode, storage_bytes
from tessera.comm.testing import WorkerPool
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import parallelize
from tessera.tensor_parallel.activations import ActivationBytes, activation_bytes_1d
from tessera.tensor_parallel.testing import gpt_loss, gpt_plan
from tessera.tensor_parallel.three_d import activation_bytes_3d
from tessera.tensor_parallel.two_d import activation_bytes_2d
from tessera.tensor_parallel.two_p5_d import activation_bytes_2p5d

E = 4  # fp32 bytes
LOSS_RTOL = 1e-5


@dataclass(frozen=True, slots=True)
class Mode:
    """One tensor-parallel layout: name, P ranks, grid side q, 2.5D depth d."""

    name: str
    world: int
    q: int = 1
    depth: int = 1

    @property
    def label(self) -> str:
        if self.name == "1d":
            return f"1d tp={self.world}"
        if self.name == "2.5d":
            return f"2.5d q={self.q} d={self.depth}"
        return f"{self.name} q={self.q}"


MODES = (
    Mode("1d", 4),
    Mode("2d", 4, q=2),
    Mode("1d", 8),
    Mode("2.5d", 8, q=2, depth=2),
    Mode("3d", 8, q=2),
)


class Trainer:
    """One mode on this rank: ``step(i)`` trains on global batch i and returns the loss."""

    def __init__(self, cfg: GPTConfig, batch: int, mode: Mode, lr: float) -> None:
        self.cfg, self.batch, self.mode = cfg, batch, mode
        self.mesh = Mesh(Topology(tp=mode.world, tp_mode=TPMode(mode.name), tp_depth=mode.depth))
        self.model = parallelize(GPT(cfg, seed=0), plan=gpt_plan(self.mesh), mesh=self.mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def loss_fn(self, idx: Tensor, targets: Tensor) -> Tensor:
        """The global mean loss (each rank is handed the whole batch; 2D/2.5D/3D take a block)."""
        return gpt_loss(self.model, idx, targets, self.mesh)

    def data(self, i: int) -> tuple[Tensor, Tensor]:
        return make_batch(self.cfg, self.batch, seed=1000 + i)

    def step(self, i: int, meter: CommMeter | None = None) -> float:
        idx, targets = self.data(i)
        if meter is None:
            loss = self.loss_fn(idx, targets)
            torch.autograd.backward(loss)
        else:
            with meter:
                loss = self.loss_fn(idx, targets)
                torch.autograd.backward(loss)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def activation_bytes(self) -> int:
        """Storage bytes autograd saves during one forward (parameters excluded); then the
        backward, gradients dropped (no optimizer step: the weights do not change)."""
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        saved: list[Tensor] = []

        def pack(t: Tensor) -> Tensor:
            if t.untyped_storage().data_ptr() not in params:
                saved.append(t)
            return t

        idx, targets = self.data(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss_fn(idx, targets)
        total = storage_bytes(saved)
        saved.clear()
        torch.autograd.backward(loss)
        self.opt.zero_grad()
        return total

    def param_bytes(self) -> int:
        return storage_bytes(self.model.parameters())


def _run(rank: int, cfg: GPTConfig, batch: int, lr: float, warmup: int, iters: int) -> dict[str, Any]:
    torch.manual_seed(0)
    world = dist.get_world_size()
    modes = [m for m in MODES if m.world == world]
    tiny = GPTConfig(vocab_size=64, seq_len=4, d_model=16, n_heads=world, n_layers=1)
    for mode in modes:  # first use of each code path outside the timings
        warm = Trainer(tiny, 4, mode, lr)
        warm.step(0)
        warm.mesh.close()
    trainers = {m.label: Trainer(cfg, batch, m, lr) for m in modes}
    out: dict[str, dict[str, Any]] = {
        label: {"activation_bytes": t.activation_bytes(), "param_bytes": t.param_bytes()}
        for label, t in trainers.items()
    }
    times: dict[str, list[float]] = {label: [] for label in trainers}
    for i in range(warmup + iters):
        for label, trainer in trainers.items():
            meter = CommMeter() if i == 0 else None
            dist.barrier()
            t0 = time.perf_counter()
            loss = trainer.step(i, meter)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
            if meter is not None:
                out[label]["first_loss"] = loss
                out[label]["comm_bytes"] = meter.volume_bytes
                out[label]["comm_by_op"] = {str(op): b for op, b in sorted(meter.by_op().items())}
            out[label]["final_loss"] = loss
    for label, trainer in trainers.items():
        out[label]["step_time_s"] = statistics.median(times[label])
        trainer.mesh.close()
    return out


# ---------------------------------------------------------------- the formulas (bytes per step)
def linear_formula(cfg: GPTConfig, batch: int, mode: Mode) -> int:
    """Bytes the blocks' Linear layers move per step (forward + backward) by the README."""
    d, h, tokens = cfg.d_model, cfg.mlp_ratio * cfg.d_model, batch * cfg.seq_len
    if mode.name == "1d":
        return 8 * tokens * d * E * cfg.n_layers
    q, dep = mode.q, mode.depth
    shapes = [(d, d)] * 4 + [(d, h), (h, d)]  # (in, out): q, k, v, out_proj, fc_in, fc_out
    total = 0
    for n_in, n_out in shapes:
        x, w, y = tokens * n_in * E, n_in * n_out * E, tokens * n_out * E
        b = n_out * E if cfg.bias else 0
        if mode.name == "2d":
            total += (3 * (x + w) + 2 * b) // q
        elif mode.name == "2.5d":
            total += (3 * (x // dep + w) + 2 * b) // q + 2 * (w + b) // (q * q)
        else:
            total += 2 * ((x + w + y) // (q * q) + b // q + b // (q * q))
    return total * cfg.n_layers


def other_formula(cfg: GPTConfig, batch: int, mode: Mode) -> tuple[int, str]:
    """Bytes of the other pieces with a README formula, and what they are."""
    d, tokens = cfg.d_model, batch * cfg.seq_len
    if mode.name == "1d":
        y = tokens * d * E
        return 2 * y + 2 * y + 24 * tokens, "blocks' f/g, vocab embedding, lm_head entry, loss"
    q, dep = mode.q, mode.depth
    norms = 2 * cfg.n_layers + 1
    w = d * E  # one norm affine's bytes (weight; bias the same)
    tables = [cfg.vocab_size * d * E, cfg.seq_len * d * E]  # token and position embeddings
    covers = "blocks' Linear, LayerNorms, token and position embeddings (not lm_head, loss)"
    if mode.name == "2d":
        t = tokens // q
        return norms * 2 * (16 * t + 2 * w // q) + sum(2 * e // q for e in tables), covers
    if mode.name == "2.5d":
        t = tokens // (q * dep)
        ln = 2 * (16 * t + 2 * w // q) + 4 * w // (q * q)
        return norms * ln + sum(2 * e // q + 2 * e // (q * q) for e in tables), covers
    t = tokens // (q * q)
    ln = 2 * (16 * t + 2 * w // q + 2 * w // (q * q))
    return norms * ln + sum(2 * (e // q + e // (q * q)) for e in tables), covers


def activation_formula(cfg: GPTConfig, batch: int, mode: Mode) -> int:
    """Activation bytes a rank saves for backward by the README's formula for ``mode``."""
    shape = {
        "batch": batch,
        "seq": cfg.seq_len,
        "hidden": cfg.d_model,
        "heads": cfg.n_heads,
        "vocab": cfg.vocab_size,
        "mlp_ratio": cfg.mlp_ratio,
    }
    per: ActivationBytes
    if mode.name == "1d":
        per = activation_bytes_1d(**shape, tp=mode.world)
    elif mode.name == "2d":
        per = activation_bytes_2d(**shape, q=mode.q)
    elif mode.name == "2.5d":
        per = activation_bytes_2p5d(**shape, q=mode.q, depth=mode.depth)
    else:
        per = activation_bytes_3d(**shape, q=mode.q)
    return per.total(cfg.n_layers)


# ---------------------------------------------------------------- the chart
def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    labels = [f"P={r['tp']}\n{r['mode_label']}" for r in records]
    colors = ["tab:blue" if r["mode"] == "1d" else "tab:orange" for r in records]
    panels = (
        ("step_time_s", "step time (s)", 1.0),
        ("comm_bytes", "bytes moved per step per rank (MiB)", 2.0**-20),
        ("activation_bytes", "peak activation bytes per rank (MiB)", 2.0**-20),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        ax.bar(range(len(records)), [r[key] * scale for r in records], color=colors)
        formula = {"comm_bytes": "formula_bytes", "activation_bytes": "formula_activation_bytes"}.get(key)
        if formula is not None:
            ax.scatter(
                range(len(records)),
                [r[formula] * scale for r in records],
                color="black",
                marker="_",
                s=400,
                label="formula (covered pieces)" if key == "comm_bytes" else "formula",
            )
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(records)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle(records[0]["config"].split(" P=")[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8, help="1D tp=8 needs 8 | heads")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch; q*d and q^2 must divide it")
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--worlds", default="4,8", help="P values to run (4 and/or 8)")
    parser.add_argument("--plot", default="benchmarks/out/tp_nd.png", help="PNG path ('' for none)")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = GPTConfig(
        vocab_size=ns.vocab,
        seq_len=ns.seq,
        d_model=ns.d_model,
        n_heads=ns.heads,
        n_layers=ns.layers,
        bias=ns.bias,
    )
    worlds = [int(w) for w in ns.worlds.split(",")]
    serial = GPT(cfg, seed=0)
    serial_params = storage_bytes(serial.parameters())
    with torch.no_grad():
        serial_loss = serial.loss(*make_batch(cfg, ns.batch, seed=1000)).item()
    per_world: dict[int, list[dict[str, Any]]] = {}
    for world in worlds:
        with WorkerPool(world, timeout=1800) as pool:
            per_world[world] = pool.run(_run, cfg, ns.batch, ns.lr, ns.warmup, ns.iters)

    psi = sum(p.numel() for p in serial.parameters())
    model = (
        f"gpt {psi / 1e6:.2f}M d={cfg.d_model} heads={cfg.n_heads} L={cfg.n_layers} V={cfg.vocab_size} "
        f"seq={cfg.seq_len} batch={ns.batch} bias={cfg.bias} SGD fp32 gloo"
    )
    records: list[dict[str, Any]] = []
    for mode in (m for m in MODES if m.world in worlds):
        runs = [r[mode.label] for r in per_world[mode.world]]
        t = max(r["step_time_s"] for r in runs)
        first = runs[0]["first_loss"]
        diff = abs(first - serial_loss)
        comm = max(r["comm_bytes"] for r in runs)
        lin = linear_formula(cfg, ns.batch, mode)
        other, covers = other_formula(cfg, ns.batch, mode)
        params = max(r["param_bytes"] for r in runs)
        act = max(r["activation_bytes"] for r in runs)
        act_formula = activation_formula(cfg, ns.batch, mode)
        records.append(
            {
                "bench": "tp-nd",
                "system": "tessera",
                "config": f"{model} P={mode.world} {mode.label}",
                "step_time_s": round(t, 4),
                "tokens_per_s": round(ns.batch * cfg.seq_len / t, 1),
                "tp": mode.world,
                "mode": mode.name,
                "mode_label": mode.label,
                "q": mode.q if mode.name != "1d" else None,
                "depth": mode.depth if mode.name == "2.5d" else None,
                "comm_bytes": comm,
                "comm_by_op": runs[0]["comm_by_op"],
                "formula_linear_bytes": lin,
                "formula_bytes": lin + other,
                "formula_covers": covers,
                "unaccounted_bytes": comm - lin - other,
                "activation_bytes": act,
                "formula_activation_bytes": act_formula,
                "activation_vs_formula": round(act / act_formula, 4),
                "param_bytes": params,
                "param_ratio_vs_serial": round(params / serial_params, 4),
                "serial_param_bytes": serial_params,
                "final_loss": round(runs[0]["final_loss"], 5),
                "loss_diff": diff,
                "loss_match": diff <= LOSS_RTOL * abs(serial_loss),
                "ratio_vs_peer": None,
            }
        )
    peers = {r["tp"]: r for r in records if r["mode"] == "1d"}
    for rec in records:
        peer = peers.get(rec["tp"])
        if rec["mode"] != "1d" and peer is not None:
            rec["ratio_vs_peer"] = round(peer["step_time_s"] / rec["step_time_s"], 3)
    for rec in records:
        emit(rec)
    table(
        records,
        (
            "tp",
            "mode_label",
            "step_time_s",
            "ratio_vs_peer",
            "comm_bytes",
            "formula_bytes",
            "activation_bytes",
            "formula_activation_bytes",
            "param_bytes",
            "loss_match",
        ),
    )
    if ns.plot and records:
        plot(records, Path(ns.plot))


if __name__ == "__main__":
    main()
