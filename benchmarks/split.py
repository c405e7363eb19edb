"""Where a split backward's time goes: one pipeline stage's backward, whole and as B + W.

A zero-bubble schedule splits each stage's backward into B (the input gradient, on the critical
path) and W (the weight gradients, run later to fill the bubble;
`tessera.pipeline.split_backward`). This times, on one stage of the reference GPT (``--layers``
blocks, one thread, a microbatch of ``--microbatch`` sequences), in rounds that interleave every
measurement so that all see the same machine:

- ``fused``: one backward of the stage, input and weight gradients together;
- ``dx_only``: autograd asked for the input gradient alone: the least B can cost;
- ``analyse``: B's walk of the graph that finds each parameter's frontier;
- ``b``: B as the runtime runs it (the walk, then one autograd call for the input gradient and
  the gradients each frontier node receives);
- ``w_hot``: W right after B; ``w_cold``: W after the caches are overwritten (``--flush-mib``
  of writes), as in a schedule, where other microbatches' work runs between a B and its W;
- ``wgrad_mm_hot`` / ``wgrad_mm_cold``: the weight-gradient products of the stage's linear
  layers alone (``grad.T @ input`` per layer, the inputs saved), warm and after the flush:
  the part of W no bookkeeping can remove.

Three lines (systems ``fused``, ``split-hot`` = b + w_hot, ``split-cold`` = b + w_cold), each
with ``ratio_vs_fused``; the ``split-cold`` line carries every part (``*_s``), ``b_over_dx_only``,
``w_over_ideal_hot`` / ``_cold`` (W over fused - dx_only, the weight gradients' share of the
fused backward) and ``wgrad_mm_cold_over_hot``. Every figure is the median over ``--rounds``
rounds, in seconds; a "token" is one sequence position of the microbatch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _common import emit, table
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from tessera.models import GPT, GPTConfig
from tessera.pipeline.split_backward import _analyse, backward_input, grad_nodes


def _timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _linear_inputs(stage: nn.Module, x: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(input, output gradient) of each linear layer of ``stage`` for a random output gradient."""
    seen: list[Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, a, _o: seen.append(a[0].detach()))
        for m in stage.modules()
        if isinstance(m, nn.Linear)
    ]
    with torch.no_grad():
        stage(x)
    for h in hooks:
        h.remove()
    out_features = [m.out_features for m in stage.modules() if isinstance(m, nn.Linear)]
    return [
        (a.flatten(0, -2), torch.randn(a.flatten(0, -2).shape[0], n))
        for a, n in zip(seen, out_features, strict=True)
    ]


def measure(
    cfg: GPTConfig, layers: int, microbatch: int, rounds: int, flush_mib: int
) -> list[dict[str, object]]:
    torch.manual_seed(0)
    stage = nn.Sequential(*list(GPT(cfg).layers)[:layers])
    params = list(stage.parameters())
    nodes = grad_nodes(params)
    x0 = torch.randn(microbatch, cfg.seq_len, cfg.d_model)
    g0 = torch.randn_like(x0)
    scratch = torch.zeros(flush_mib * 2**18)  # float32: 4 bytes each
    pairs = _linear_inputs(stage, x0)

    def fresh() -> tuple[Tensor, Tensor]:
        x = x0.clone().requires_grad_()
        return x, stage(x)

    def mm_all() -> None:
        for a, g in pairs:
            g.t() @ a

    times: dict[str, list[float]] = {
        k: []
        for k in ("fused", "dx_only", "analyse", "b", "w_hot", "w_cold", "wgrad_mm_hot", "wgrad_mm_cold")
    }
    for r in range(rounds + 2):  # two warm-up rounds
        got: dict[str, float] = {}
        x, y = fresh()
        got["fused"] = _timed(torch.autograd.backward, y, g0)
        x, y = fresh()
        got["dx_only"] = _timed(torch.autograd.grad, y, [x], g0)
        x, y = fresh()
        assert y.grad_fn is not None
        got["analyse"] = _timed(_analyse, y.grad_fn, get_gradient_edge(x).node, params, nodes)
        for kind in ("hot", "cold"):
            x, y = fresh()
            start = time.perf_counter()
            _, weights = backward_input(y, g0, x, params, nodes)
            got["b"] = time.perf_counter() - start
            if kind == "cold":
                scratch.add_(1.0)
            got[f"w_{kind}"] = _timed(weights.run)
        mm_all()
        got["wgrad_mm_hot"] = _timed(mm_all)
        scratch.add_(1.0)
        got["wgrad_mm_cold"] = _timed(mm_all)
        if r >= 2:
            for k, v in got.items():
                times[k].append(v)
        for p in params:
            p.grad = None
    med = {k: statistics.median(v) for k, v in times.items()}
    ideal_w = med["fused"] - med["dx_only"]
    tokens = microbatch * cfg.seq_len
    config = f"gpt d{cfg.d_model} seq{cfg.seq_len} {layers} blocks, microbatch {microbatch}"
    parts = {f"{k}_s": round(v, 6) for k, v in med.items()}
    records = []
    for system, step in [
        ("fused", med["fused"]),
        ("split-hot", med["b"] + med["w_hot"]),
        ("split-cold", med["b"] + med["w_cold"]),
    ]:
        records.append(
            {
                "bench": "split",
                "system": system,
                "config": config,
                "step_time_s": round(step, 6),
                "tokens_per_s": round(tokens / step, 1),
                "ratio_vs_fused": round(step / med["fused"], 3),
            }
        )
    records[-1].update(
        {
            **parts,
            "b_over_dx_only": round(med["b"] / med["dx_only"], 3),
            "w_over_ideal_hot": round(med["w_hot"] / ideal_w, 3),
            "w_over_ideal_cold": round(med["w_cold"] / ideal_w, 3),
            "wgrad_mm_cold_over_hot": round(med["wgrad_mm_cold"] / med["wgrad_mm_hot"], 3),
        }
    )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--flush-mib", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        vocab_size=512, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.layers
    )
    records = measure(cfg, args.layers, args.microbatch, args.rounds, args.flush_mib)
    for record in records:
        emit(record)
    table(records, ("system", "config", "step_time_s", "ratio_vs_fused"))


if __name__ == "__main__":
    main()
