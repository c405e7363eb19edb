"""The DeepSpeed-MoE peer of ``benchmarks/moe.py``: one rank, run in DeepSpeed's own Python
(``peers.peer_python("deepspeed")``) beside the others of its world.

The same reference GPT (``tessera.models.GPT``, put on ``PYTHONPATH``) with every layer's
MLP replaced by ``deepspeed.moe.layer.MoE``: ``experts`` SwiGLU experts of the bench's width
(``w1``, ``w3``: d -> h, ``w2``: h -> d, no biases, as ``tessera.moe``), top-k gating with the
same capacity factor (tokens beyond it dropped, no random token selection; ``--dropless``:
``drop_tokens=False``), expert parallelism over every rank (``ep_size = world``). With a
shared expert (``--shared-hidden``), DeepSpeed's nearest layer: Residual-MoE
(``use_residual``), a dense copy of the expert whose output is mixed with the mixture's by a
learned per-token coefficient (two more d-wide weights; the shared expert must be as wide as
the experts). The loss is the cross-entropy plus
``aux_coef`` times the layers' load-balancing losses (DeepSpeed has no router z-loss).
``deepspeed.initialize`` with ZeRO stage 1 and AdamW (lr 1e-3) on the parameter groups
DeepSpeed splits for MoE (expert parameters reduced over their expert-data-parallel group),
gloo (``DS_ACCELERATOR=cpu``). Each rank trains its contiguous rows of the bench's global
batch; after ``warmup`` steps it times ``iters`` and prints one JSON line: its step times,
losses and parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from _memory_peers import deepspeed_gloo
from torch import Tensor, nn

from tessera.models import GPT, GPTConfig


class _SwiGLU(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class _Mixture(nn.Module):
    """``deepspeed.moe.layer.MoE`` as a layer's MLP: its output, its load-balancing loss kept."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.moe = layer
        self.aux: Tensor = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        out, self.aux, _ = self.moe(x)
        return out  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "d_model", "heads", "layers", "mlp_ratio", "vocab", "seq", "batch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    for name in ("experts", "top_k", "warmup", "iters", "expert_hidden", "shared_hidden"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    parser.add_argument("--capacity-factor", type=float, required=True)
    parser.add_argument("--aux-coef", type=float, required=True)
    parser.add_argument("--dropless", action="store_true")
    parser.add_argument("--store", required=True)
    args = parser.parse_args()

    import deepspeed  # type: ignore[import-not-found, unused-ignore]
    from deepspeed.moe.layer import MoE  # type: ignore[import-not-found, unused-ignore]
    from deepspeed.moe.utils import (  # type: ignore[import-not-found, unused-ignore]
        split_params_into_different_moe_groups_for_optimizer,
    )

    rank, world = args.rank, args.world
    deepspeed_gloo(args.store, rank, world)
    cfg = GPTConfig(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.mlp_ratio)
    model = GPT(cfg, seed=0)
    hidden = args.expert_hidden
    if args.shared_hidden not in (0, hidden):
        raise SystemExit(
            f"DeepSpeed's residual expert is as wide as the experts ({hidden}), not {args.shared_hidden}"
        )
    for block in model.layers:
        block.mlp = _Mixture(
            MoE(
                hidden_size=args.d_model,
                expert=_SwiGLU(args.d_model, hidden),
                num_experts=args.experts,
                ep_size=world,
                k=args.top_k,
                capacity_factor=args.capacity_factor,
                eval_capacity_factor=args.capacity_factor,
                min_capacity=0,
                drop_tokens=not args.dropless,
                use_rts=False,
                use_residual=args.shared_hidden > 0,
            )
        )
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"}
    )
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 2**30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf)
    mixtures = [m for m in model.modules() if isinstance(m, _Mixture)]
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    times, losses = [], []
    for step in range(args.warmup + args.iters):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)[rows]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        logits = engine(tokens[:, :-1])
        entropy = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(entropy + args.aux_coef * sum(m.aux for m in mixtures))
        engine.step()
        elapsed = time.perf_counter() - t0
        losses.append(float(entropy.detach()))  # as the Tessera engines report theirs
        if step >= args.warmup:
            times.append(elapsed)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    record = {"rank": rank, "step_s": statistics.median(times), "losses": losses, "param_bytes": held}
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
