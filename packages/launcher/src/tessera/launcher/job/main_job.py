"""The main job: a character-level GPT trained on the Python standard library's own source, or
a GPT on the user's own data (``data.path``: ``tessera.launcher.data.prepare``, ``token_data``).

Run it with ``tessera train --config configs/main.toml`` (``hatch run train``); every rank
executes this module. Rank 0 shows progress and writes the run folder under
``train.run_dir``: ``metrics.jsonl`` (a ``loss`` field per logged step, ``val_loss`` at each
evaluation), ``plot.png`` (loss and tokens/s), ``tensorboard/`` (the same scalars as
TensorBoard event files, when the ``tensorboard`` package is installed: ``runlog``),
``checkpoint/`` (the resumable engine state), ``model.safetensors`` (the consolidated serial
model), ``tokenizer.json`` and ``sample.txt`` (text the trained model generates). Before a
fresh run trains, rank 0 times plain single-process PyTorch training of the same model on
every core (``serial_tokens_per_s`` in ``metrics.jsonl``, a reference line in the plot) and
the end of the run logs the parallel job's throughput as a multiple of it. With ``[moe]`` on,
every layer's MLP is a mixture of experts (``moe_model``) and each logged step also records
each expert's share of the routed tokens and the fraction dropped for capacity.

SIGINT (Ctrl-C), SIGTERM (a preemption) or SIGUSR1 (a time limit near) stops the job after the next step on
every rank: it saves a generation there, says where and ends without a traceback
(``tessera.launcher.run.stopping``). ``train.resume`` naming that checkpoint goes on in the same
run folder (``tessera.launcher.run.runs``), its metrics appended.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.launcher import Config, Engine, boost, load_config
from tessera.launcher.checkpoint import generation_name, saved_vocab
from tessera.launcher.config import config_to_toml
from tessera.launcher.data import Data, TokenData, open_data
from tessera.launcher.job.moe_model import MOE_GPT_SPEC, ExpertLoad, moe_gpt
from tessera.launcher.job.optim import lr_factor, optimizer_for
from tessera.launcher.job.runlog import MetricsWriter, Progress, plot_metrics, read_metrics, truncate_metrics
from tessera.launcher.job.serial_speed import best_serial_tokens_per_s
from tessera.launcher.job.start import join_ranks, resume_point
from tessera.launcher.job.stop import StopRequest
from tessera.launcher.run import CHECKPOINT_DIR, run_folder
from tessera.models import GPT, GPTConfig
from tessera.moe import set_aux_grad_scale

__all__ = ["main", "sample"]

log = logging.getLogger("tessera.train")

Batch: TypeAlias = tuple[torch.Tensor | None, torch.Tensor | None]  # a rank's (inputs, targets)


@torch.no_grad()
def sample(model: GPT, data: Data, *, prompt: str, chars: int, seed: int, temperature: float = 0.8) -> str:
    """Text the serial model writes after ``prompt`` (multinomial sampling, seeded)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = data.tokenizer.encode(prompt).tolist()
    vocab = data.tokenizer.vocab_size
    for _ in range(chars):
        window = torch.tensor([ids[-model.config.seq_len :]])
        logits = model(window)[0, -1, :vocab] / temperature
        ids.append(int(torch.multinomial(F.softmax(logits, -1), 1, generator=gen)))
    return data.tokenizer.decode(ids)


def build_model(gpt_cfg: GPTConfig, config: Config, *, seed: int) -> GPT:
    """The main job's model: the reference GPT, with mixture-of-experts MLPs when ``[moe]`` is on."""
    return moe_gpt(gpt_cfg, config.moe, seed=seed) if config.moe.enabled else GPT(gpt_cfg, seed=seed)


def _run_dir(config: Config, device: torch.device) -> Path:
    return run_folder(config, device)


def _rank_batch(engine: Engine, data: Data, split: str, step: int, batch_size: int) -> Batch:
    """What this rank's engine reads of batch ``step``: its replica's rows, the inputs and
    targets only where its stages read them (for ``train_step(..., local=True)``)."""
    return data.parts(split, step, batch_size, rows=engine.local_rows(batch_size), needs=engine.batch_needs)


def _evaluate(engine: Engine, data: Data, config: Config, step: int) -> float:
    losses = [
        engine.eval_loss(
            *_rank_batch(engine, data, "val", step * 1000 + i, config.data.batch_size), local=True
        )
        for i in range(config.train.eval_batches)
    ]
    return sum(losses) / len(losses)


def _serial_reference(
    gpt_cfg: GPTConfig, config: Config, data: Data, device: torch.device
) -> dict[str, float]:
    """The ``serial_tokens_per_s`` record: plain PyTorch training of the same model, one process."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(gpt_cfg, config, seed=config.train.seed).to(device)
        return model, optimizer_for(config, model.parameters())

    speed = best_serial_tokens_per_s(
        make,
        lambda i: data.batch("train", i, config.data.batch_size),
        device=device,
        clip_grad_norm=config.optim.clip_grad_norm,
    )
    log.info(
        "single-process reference (plain PyTorch, threads=%d): %.0f tokens/s",
        speed.threads,
        speed.tokens_per_s,
    )
    return {"step": 0, "serial_tokens_per_s": speed.tokens_per_s, "threads": speed.threads}


def _mean_speed(records: list[dict[str, Any]]) -> float:
    """Mean tokens/s of the logged windows after the first (which holds start-up)."""
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    speeds = speeds[1:] or speeds
    return sum(speeds) / len(speeds) if speeds else 0.0


def _with_vocab(config: Config, data_vocab: int, resume: str) -> tuple[Config, int]:
    """The model's vocabulary: ``model.vocab_size``, else the one the checkpoint being resumed
    trained with (never re-derived: another tp would pad it otherwise), else the data's padded
    to split over tp. The config then records it, so every checkpoint says it."""
    vocab = config.model.vocab_size or (saved_vocab(resume) if resume else 0)
    if not vocab:
        tp = config.parallel.tp
        vocab = -(-data_vocab // tp) * tp
        if resume:  # a checkpoint that recorded no vocabulary (0): its configuration stays as it was
            return config, vocab
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab)), vocab


def main() -> None:
    """Train, evaluate, checkpoint, consolidate, sample and plot (collective over every rank).
    SIGINT, SIGTERM or SIGUSR1: stop after the step every rank agrees on, save there and return
    (``tessera.launcher.run.stopping``)."""
    with StopRequest() as stop:
        _train(stop)


def _train(stop: StopRequest) -> None:
    config = load_config()
    device = join_ranks()
    rank = dist.get_rank()
    data = open_data(config)  # the built-in corpus, or data.path's token files
    run = _run_dir(config, device)
    resume, restarts = resume_point(config, run)
    config, vocab = _with_vocab(config, data.vocab_size, resume)
    m = config.model
    gpt_cfg = GPTConfig(vocab, m.seq_len, m.d_model, m.n_heads, m.n_layers, m.mlp_ratio, m.dropout, True)
    model = build_model(gpt_cfg, config, seed=config.train.seed).to(device)
    load = ExpertLoad(model) if config.moe.enabled else None
    factor = lr_factor(config)
    engine = boost(
        model,
        optimizer_for(config, model.parameters()),
        config,
        spec=MOE_GPT_SPEC if config.moe.enabled else None,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
    )
    if resume:
        generation = engine.load(resume)  # returns once every rank has loaded
        log.info("resumed from %s at step %d (restart %d)", generation, engine.step, restarts)
    metrics = progress = None
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.toml").write_text(config_to_toml(config))
        (run / "tokenizer.json").write_text(data.tokenizer.to_json())
        truncate_metrics(run / "metrics.jsonl", engine.step)  # a resumed run writes them again
        metrics = MetricsWriter(run / "metrics.jsonl", board=run / "tensorboard", purge_step=engine.step)
        if engine.step == 0:  # a resumed run keeps the record it wrote at the start
            metrics.write(**_serial_reference(gpt_cfg, config, data, device))
        progress = Progress(config.train.steps)
        log.info(
            "training %s on %d tokens (vocab %d) into %s",
            engine.mesh.topology.describe(),
            data.tokens,
            data.vocab_size,
            run,
        )
        if isinstance(data, TokenData):
            epoch, at = data.position("train", engine.step, config.data.batch_size)
            log.info(
                "data position: step %d = epoch %d, sample %d of %d",
                engine.step,
                epoch,
                at,
                data.samples["train"],
            )
    dist.barrier()  # the other ranks wait while rank 0 times the single-process reference
    tokens = config.data.batch_size * m.seq_len
    started = time.perf_counter()
    window_start, window_steps = started, 0
    checkpoints, stopped = run / CHECKPOINT_DIR, 0
    for step in range(engine.step, config.train.steps):
        if load is not None:  # the attached router losses follow the loss's scale and microbatches
            set_aux_grad_scale(model, engine.zero.loss_scale / config.parallel.microbatches)
        out = engine.train_step(*_rank_batch(engine, data, "train", step, config.data.batch_size), local=True)
        window_steps += 1
        done = step + 1
        if done % config.train.log_every == 0 or done == config.train.steps:
            now = time.perf_counter()
            speed = tokens * window_steps / (now - window_start)
            window_start, window_steps = now, 0
            moe = {} if load is None else load.collect(device=engine.mesh.device)  # collective
            if metrics is not None and progress is not None:
                metrics.write(
                    step=done,
                    loss=out.loss,
                    lr=out.lr,
                    grad_norm=out.grad_norm,
                    tokens_per_s=speed,
                    elapsed_s=now - started,
                    skipped=out.skipped,
                    **moe,
                )
                progress.update(done, loss=out.loss, tok_s=speed)
        if done % config.train.eval_every == 0 or done == config.train.steps:
            val = _evaluate(engine, data, config, done)
            if metrics is not None:
                metrics.write(step=done, val_loss=val)
                log.info("step %d: validation loss %.4f", done, val)
            if window_steps == 0:  # evaluation time is not training throughput
                window_start = time.perf_counter()
        if config.train.checkpoint_every and done % config.train.checkpoint_every == 0:
            background = config.train.checkpoint_async and done < config.train.steps
            engine.save(checkpoints, keep_last=config.train.keep_last, background=background)
        stopped = stop.agreed(engine.mesh.device)  # collective: every rank stops after the same step
        if stopped:
            break
    if not (config.train.checkpoint_every and engine.step % config.train.checkpoint_every == 0):
        engine.save(checkpoints, keep_last=config.train.keep_last)  # commits a pending one first
    if stopped:
        at = engine.step
        if metrics is not None:
            metrics.close()
        engine.close()  # commits a generation still being written in the background
        stop.announce(stopped, at, checkpoints / generation_name(at), checkpoints)
        dist.destroy_process_group()
        return
    full = engine.consolidate(run / "model.safetensors")
    if rank == 0 and metrics is not None:
        metrics.close()
        text = ""
        if full is not None:
            serial = build_model(gpt_cfg, config, seed=0)
            serial.load_state_dict(full)
            # a function definition at the start of a line; 0.6 keeps the sample in code rather than prose
            chars, seed = config.train.sample_chars, config.train.seed
            prompt = data.prompt() if isinstance(data, TokenData) else "\ndef "
            text = sample(serial, data, prompt=prompt, chars=chars, seed=seed, temperature=0.6)
            (run / "sample.txt").write_text(text)
        records = read_metrics(run / "metrics.jsonl")
        plot_metrics(records, run / "plot.png")
        reference = next((r["serial_tokens_per_s"] for r in records if "serial_tokens_per_s" in r), 0.0)
        if reference > 0:
            parallel = _mean_speed(records)
            log.info(
                "throughput: %.0f tokens/s on %d processes, %.2fx the single-process run (%.0f tokens/s)",
                parallel,
                dist.get_world_size(),
                parallel / reference,
                reference,
            )
        files = "metrics.jsonl, plot.png, checkpoint/, model.safetensors, tokenizer.json, sample.txt"
        log.info(
            "done in %.0f s. Run folder %s: %s. Sample:\n%s",
            time.perf_counter() - started,
            run,
            files,
            text,
        )
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
