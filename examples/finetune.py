"""Fine-tune your own model: a frozen backbone, and targets that count only the answers.

    tessera run --nproc-per-node 2 --set parallel.dp=2 --set zero.stage=3 examples/finetune.py
    tessera run --nproc-per-node 2 --set parallel.tp=2 examples/finetune.py
    tessera run --nproc-per-node 2 --set parallel.pp=2 examples/finetune.py --steps 20

The model is ``own_model.py``'s, taken as "pretrained"; its embedding and first two layers
are frozen (``requires_grad_(False)``), and the optimizer holds only what trains. Each
sequence is a prompt (a count with a fixed stride) followed by its continuation; the targets
of the prompt are -100, as are those of the padding after a shorter answer, so only the
answers' tokens count. ``verify=True`` checks the first step against the serial model on the
same batch; at the end every frozen weight must be exactly what it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.launcher import boost, load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))  # own_model.py beside this script
from own_model import ROLES, SEQ, VOCAB, MyModel

FROZEN = ("embed", "layers.0", "layers.1")
PROMPT = SEQ // 2  # the first half of every sequence is the prompt


def batch(step: int, size: int) -> tuple[Tensor, Tensor]:
    """Prompt + answer; answers of every other row stop early (padding). Targets of the prompt
    and of the padding are -100: they count for nothing."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, : PROMPT - 1] = -100  # the prompt predicts nothing that counts
    targets[::2, SEQ - 3 :] = -100  # shorter answers: padding at the end
    return inputs, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    args = parser.parse_args()

    config = load_config()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = MyModel()  # stands for a pretrained model
    for name in FROZEN:
        model.get_submodule(name).requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.1)
    engine = boost(model, optimizer, config, plan=ROLES, verify=True)
    first = last = 0.0
    for step in range(args.steps):
        out = engine.train_step(*batch(step, args.batch))
        first, last = (out.loss if step == 0 else first), out.loss
    held = engine.full_state_dict()  # this rank's stages, full tensors by serial name
    same = sum(torch.equal(held[n], before[n]) for n in before if n in held)
    counts = torch.tensor([same, sum(n in held for n in before)])
    dist.all_reduce(counts)  # over every rank: each counts the frozen weights it holds
    if dist.get_rank() == 0:
        layout = config.parallel.topology().describe()
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps ({layout})")
        print(f"frozen weights unchanged: {counts[0]} of {counts[1]} held")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
