"""``tessera finetune``: LoRA fine-tuning of a pretrained Hugging Face model on a jsonl file.

Every rank: the tokenizer and the examples from ``[finetune]`` (rows of ``finetune.seq_len``
tokens, the loss on the responses only: ``tessera.launcher.data.finetune``); the model built
from its ``config.json`` with its parameters deferred (nothing allocated), wrapped by PEFT's
``LoraConfig``, boosted in the configured layout (each rank makes only what it holds), then
given the pretrained weights streamed from the folder one tensor at a time, and new adapters
as PEFT starts them (``lora_A`` Kaiming-uniform, seeded by ``train.seed``; ``lora_B`` zero: the
model starts as the pretrained one). Only the adapters train (the optimizer of ``[optim]``,
warm-up and cosine of ``[train]``); with ``train.precision`` bf16 the frozen base is held in
bf16 alone. Metrics and progress as in the main job, checkpoint generations every
``train.checkpoint_every`` steps (``train.resume`` and elastic restarts go on from them). At the
end, in the run folder: ``adapter/`` (PEFT's files: ``PeftModel.from_pretrained``) and
``merged/`` (the model with the adapters merged, its config and tokenizer: what
``AutoModelForCausalLM.from_pretrained`` loads without PEFT).
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.launcher import Config, boost, deferred_parameters, load_config
from tessera.launcher.config import config_to_toml
from tessera.launcher.data import finetune_data, load_tokenizer
from tessera.launcher.job.optim import lr_factor, optimizer_for
from tessera.launcher.job.runlog import MetricsWriter, Progress, plot_metrics, read_metrics, truncate_metrics
from tessera.launcher.job.start import join_ranks, resume_point
from tessera.launcher.run import run_folder

__all__ = ["adapter_start", "lora_model", "main"]

log = logging.getLogger("tessera.finetune")


def lora_model(config: Config) -> nn.Module:
    """The pretrained model of ``finetune.model`` built from its config with deferred
    parameters, wrapped by PEFT with ``[finetune]``'s adapters."""
    peft: Any = importlib.import_module("peft")  # optional: what users already have (pip install peft)
    transformers: Any = importlib.import_module("transformers")
    f = config.finetune
    base_config = transformers.AutoConfig.from_pretrained(f.model, local_files_only=True)
    with deferred_parameters():
        base = transformers.AutoModelForCausalLM.from_config(base_config)
    lora = peft.LoraConfig(
        r=f.rank,
        lora_alpha=f.alpha,
        lora_dropout=f.dropout,
        target_modules=f.target_modules(),
        modules_to_save=f.saved_whole(),
    )
    wrapped: nn.Module = peft.get_peft_model(base, lora)
    return wrapped


def adapter_start(shapes: dict[str, tuple[int, ...]], *, seed: int) -> dict[str, Tensor]:
    """The new adapters' first values by serial name, as PEFT starts LoRA: each ``lora_A``
    Kaiming-uniform (a = sqrt 5, drawn in name order from a generator seeded ``seed``: the same
    on every rank), each ``lora_B`` zero."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) of an (r, in) weight
            out[name] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        elif ".lora_B." in name:
            out[name] = torch.zeros(shape)
    return out


def _zeros(name: str, module: nn.Module) -> None:
    """Deferred values before the pretrained weights arrive: nothing is trained on them."""
    for p in module.parameters(recurse=False):
        nn.init.zeros_(p)


def main() -> None:
    """Fine-tune, checkpoint, save the adapters and the merged model (collective over every rank)."""
    config = load_config()
    device = join_ranks()
    rank, f = dist.get_rank(), config.finetune
    tokenizer = load_tokenizer(f.model)
    data = finetune_data(
        f.data,
        tokenizer,
        seq_len=f.seq_len,
        packing=f.packing,
        prompt_field=f.prompt_field,
        response_field=f.response_field,
        messages_field=f.messages_field,
    )
    run = run_folder(config, device)
    resume, restarts = resume_point(config, run)
    model = lora_model(config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    factor = lr_factor(config)
    engine = boost(
        model,
        optimizer_for(config, trainable),
        config,
        init=_zeros,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
    )
    if resume:
        generation = engine.load(resume)
        log.info("resumed from %s at step %d (restart %d)", generation, engine.step, restarts)
    else:
        new = {n: s for n, s in engine.placement.full_shapes.items() if ".lora_" in n}
        engine.import_weights(f.model, extra=adapter_start(new, seed=config.train.seed))
    metrics = progress = None
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.toml").write_text(config_to_toml(config))
        truncate_metrics(run / "metrics.jsonl", engine.step)
        metrics = MetricsWriter(run / "metrics.jsonl", board=run / "tensorboard", purge_step=engine.step)
        progress = Progress(config.train.steps)
        held = sum(p.numel() for p in trainable)
        log.info(
            "fine-tuning %s: %d examples in %d rows of %d tokens (%d response tokens), %d adapter "
            "parameters, %s, into %s",
            f.model, data.examples, data.rows, data.seq_len, data.response_tokens, held,
            engine.mesh.topology.describe(), run,
        )  # fmt: skip
    tokens = config.data.batch_size * data.seq_len
    started = window = time.perf_counter()
    steps_in_window = 0
    for step in range(engine.step, config.train.steps):
        ids, targets = data.batch(step, config.data.batch_size, seed=config.train.seed)
        out = engine.train_step(ids.to(engine.mesh.device), targets.to(engine.mesh.device))
        steps_in_window += 1
        done = step + 1
        if done % config.train.log_every == 0 or done == config.train.steps:
            now = time.perf_counter()
            speed = tokens * steps_in_window / (now - window)
            window, steps_in_window = now, 0
            if metrics is not None and progress is not None:
                metrics.write(
                    step=done, loss=out.loss, lr=out.lr, grad_norm=out.grad_norm, tokens_per_s=speed,
                    elapsed_s=now - started, skipped=out.skipped,
                )  # fmt: skip
                progress.update(done, loss=out.loss, tok_s=speed)
        if config.train.checkpoint_every and done % config.train.checkpoint_every == 0:
            engine.save(run / "checkpoint", keep_last=config.train.keep_last)
    engine.save_adapter(run / "adapter")
    engine.export_merged(run / "merged")
    if rank == 0 and metrics is not None:
        metrics.close()
        base: Any = model.get_base_model()  # type: ignore[operator]
        base.config.save_pretrained(run / "merged")
        tokenizer.save_pretrained(run / "merged")
        records: list[dict[str, Any]] = read_metrics(run / "metrics.jsonl")
        plot_metrics(records, run / "plot.png")
        log.info(
            "done in %.0f s. Run folder %s: metrics.jsonl, plot.png, adapter/ (PEFT), merged/ (transformers)",
            time.perf_counter() - started,
            run,
        )
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
