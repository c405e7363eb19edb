"""LoRA fine-tuning of a pretrained Hugging Face model: through boost() in a script, then the
same job as one command.

    tessera run --nproc-per-node 2 --set parallel.tp=2 examples/lora.py
    tessera finetune --nproc-per-node 2 --set parallel.tp=2 --set train.steps=40 \\
        --set finetune.model=lora-example/pretrained --set finetune.data=lora-example/chat.jsonl

The script makes a small "pretrained" Llama folder (``save_pretrained``: random weights and a
tokenizer made here, so nothing is downloaded) and a jsonl file of chats under
``lora-example/``, wraps the model with ``peft`` (rank 8 on every projection), trains only the
adapters on the assistants' replies in any layout, saves the adapters in PEFT's format and the
merged model, and loads both back in one process: their loss on a held-out reply is the
engine's. The second command trains the same folder and file with ``tessera finetune``
(``[finetune]``: deferred build, the pretrained weights streamed in), writing ``adapter/`` and
``merged/`` in its run folder. Needs ``transformers`` and ``peft``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from tessera.launcher import boost, load_config
from tessera.launcher.data import finetune_data
from tessera.launcher.testing import tiny_pretrained

FOLDER = Path("lora-example")
COLOURS = ["red", "green", "blue", "brown", "black", "white"]


def chats(path: Path, n: int = 48) -> None:
    """Chats whose replies follow a rule: the fox's colour is the one after the colour asked."""
    lines = []
    for i in range(n):
        asked, next_one = COLOURS[i % 6], COLOURS[(i + 1) % 6]
        chat = [
            {"role": "user", "content": f"the {asked} fox?"},
            {"role": "assistant", "content": f"{next_one} fox"},
        ]
        lines.append(json.dumps({"messages": chat}) + "\n")
    path.write_text("".join(lines))


def mean_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    config = load_config()
    dist.init_process_group("gloo")
    if dist.get_rank() == 0 and not (FOLDER / "pretrained" / "config.json").is_file():
        FOLDER.mkdir(exist_ok=True)
        tiny_pretrained(FOLDER / "pretrained", hidden=64)  # random weights: a stand-in for a download
        chats(FOLDER / "chat.jsonl")
    dist.barrier()
    tokenizer = transformers.AutoTokenizer.from_pretrained(FOLDER / "pretrained")
    data = finetune_data(FOLDER / "chat.jsonl", tokenizer, seq_len=16)
    base = transformers.AutoModelForCausalLM.from_pretrained(FOLDER / "pretrained")
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=projections)
    torch.manual_seed(0)  # PEFT draws the adapters' first values: the same on every rank
    model = peft.get_peft_model(base, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = sum(p.numel() for p in trainable), sum(p.numel() for p in model.parameters())  # before boost
    engine = boost(model, torch.optim.AdamW(trainable, lr=1e-2), config)
    held_out = data.batch(10_000, 8, seed=1)
    first = engine.eval_loss(*held_out)
    for step in range(args.steps):
        engine.train_step(*data.batch(step, 8, seed=0))
    last = engine.eval_loss(*held_out)
    engine.save_adapter(FOLDER / "adapter")
    engine.export_merged(FOLDER / "merged")
    if dist.get_rank() == 0:
        base.config.save_pretrained(FOLDER / "merged")
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(FOLDER / "pretrained"), FOLDER / "adapter"
        )
        merged = transformers.AutoModelForCausalLM.from_pretrained(FOLDER / "merged")
        print(f"trained {counts[0]} adapter parameters of {counts[1]}")
        print(f"held-out loss {first:.4f} -> {last:.4f}")
        print(
            f"held-out loss {last:.4f} in Tessera, {mean_loss(with_adapter, *held_out):.4f} in peft, "
            f"{mean_loss(merged, *held_out):.4f} merged in transformers"
        )
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
