"""Train a Hugging Face Llama made from a config, then load the exported weights into transformers.

    tessera run --nproc-per-node 2 --set parallel.tp=2 examples/hf_llama.py
    tessera run --nproc-per-node 4 --set parallel.dp=2 --set parallel.pp=2 examples/hf_llama.py --layers 4

``LlamaForCausalLM`` comes with a registered spec (its plan, pipeline blocks and names), so
``boost`` needs no glue. Nothing is downloaded: the model is built from a ``LlamaConfig``
with grouped-query attention. After training, ``consolidate`` writes one safetensors file by
Hugging Face names; rank 0 loads it strictly into a fresh ``LlamaForCausalLM`` and checks
that its loss is the engine's.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from tessera.launcher import boost, load_config

VOCAB, SEQ = 96, 32


def llama_config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences counting up by a stride of 1-3 from a random start: something to learn."""
    g = torch.Generator().manual_seed(step)
    start, stride = (
        torch.randint(0, VOCAB, (size, 1), generator=g),
        torch.randint(1, 4, (size, 1), generator=g),
    )
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default="llama.safetensors")
    args = parser.parse_args()

    config = load_config()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = transformers.LlamaForCausalLM(llama_config(args.layers))
    engine = boost(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)
    for step in range(args.steps):
        out = engine.train_step(*batch(step))
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {out.loss:.4f}")
    ids, targets = batch(10_000)
    loss = engine.eval_loss(ids, targets)
    engine.consolidate(args.out)
    if dist.get_rank() == 0:
        fresh = transformers.LlamaForCausalLM(llama_config(args.layers))
        fresh.load_state_dict(load_file(args.out), strict=True)
        with torch.no_grad():
            logits = fresh(ids).logits
        again = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        print(f"held-out loss {loss:.5f} in Tessera, {again:.5f} in transformers from {args.out}")
        if abs(again - loss) > 1e-4 * abs(loss):
            raise SystemExit(f"the exported model's loss {again} is not the engine's {loss}")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
