"""``tessera finetune`` end to end: a pretrained Hugging Face folder and a jsonl file in, LoRA
adapters for PEFT and a merged model for ``transformers`` out, equal to the serial PEFT run.

The "pretrained" model is a tiny Llama saved by ``save_pretrained`` with a tokenizer made here
(``tiny_tokenizer``, a chat template); the examples mix prompt/response pairs and chats. The
command runs on 2 processes with tp=2 and sequence parallelism, SGD with momentum and the cosine
schedule; the serial run is plain PEFT in this process on the same rows (``finetune_data``),
its adapters started as the job starts them (``adapter_start``), loss the mean cross-entropy over
the response tokens. Bounds: losses rel 1e-5 and adapter weights atol 1e-6 + rtol 1e-5 (fp32,
4 SGD steps: round-off only, as ``tests/test_lora.py``); logits of the saved adapter and the
merged model rtol 1e-4, atol 1e-5 (a forward's round-off; the merge sums in another order). The
same command started again by SLURM (``SLURM_RESTART_COUNT``, a requeue) after its generation at
step 2 goes on in its run folder from there and ends with the same adapters exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from tessera.launcher.checkpoint.generations import MANIFEST
from tessera.launcher.config.config_io import resolve_config
from tessera.launcher.data import finetune_data, load_tokenizer
from tessera.launcher.families.adapters import PEFT_PREFIX
from tessera.launcher.job.finetune_job import adapter_start
from tessera.launcher.job.optim import lr_factor, optimizer_for
from tessera.launcher.testing import tiny_pretrained

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SETS = [
    "parallel.tp=2", "parallel.sequence_parallel=true", "data.batch_size=4", "train.steps=4",
    "train.log_every=1", "train.checkpoint_every=2", "train.precision=fp32", "optim.name=sgd",
    "optim.lr=0.05", "optim.momentum=0.9", "optim.weight_decay=0.0", "optim.warmup_steps=1",
    "optim.clip_grad_norm=0.0", "finetune.seq_len=24", "finetune.rank=4", "finetune.alpha=8.0",
    "finetune.modules_to_save=lm_head",  # the head trained whole: PEFT's trained copy
]  # fmt: skip


def _examples(path: Path) -> Path:
    lines = []
    for i in range(10):
        lines.append({"prompt": f"what is {i} plus two?", "response": f"the quick fox {i}"})
        chat = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": f"hello {i}"}]
        lines.append({"messages": chat})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _launch(tmp: Path, name: str, *sets: str, env: dict[str, str] | None = None) -> tuple[list[float], Path]:
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "finetune", "--nproc-per-node", "2"]
    for s in [*SETS, f"train.run_dir={tmp / 'runs'}", f"train.name={name}", *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp / "runs" / name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], run


def _serial(model_dir: Path, data_path: Path) -> tuple[list[float], Any]:
    config = resolve_config(None, [*SETS, f"finetune.model={model_dir}", f"finetune.data={data_path}"])
    f = config.finetune
    data = finetune_data(data_path, load_tokenizer(model_dir), seq_len=f.seq_len)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=f.rank, lora_alpha=f.alpha, target_modules=f.target_modules(), modules_to_save=f.saved_whole()
        ),
    )
    named = dict(model.named_parameters())
    shapes = {k.removeprefix(PEFT_PREFIX): tuple(p.shape) for k, p in named.items() if ".lora_" in k}
    with torch.no_grad():
        for name, value in adapter_start(shapes, seed=config.train.seed).items():
            named[PEFT_PREFIX + name].copy_(value)
    optimizer = optimizer_for(config, [p for p in model.parameters() if p.requires_grad])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config))
    losses = []
    for step in range(config.train.steps):
        ids, targets = data.batch(step, config.data.batch_size, seed=config.train.seed)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    return losses, model


def test_finetune_equals_the_serial_peft_run_and_its_outputs_load(tmp_path: Path) -> None:
    model_dir, data_path = tiny_pretrained(tmp_path / "pretrained"), _examples(tmp_path / "chat.jsonl")
    sources = [f"finetune.model={model_dir}", f"finetune.data={data_path}"]
    losses, run = _launch(tmp_path, "tuned", *sources)
    want, serial = _serial(model_dir, data_path)
    assert losses == pytest.approx(want, rel=1e-5)
    saved = safetensors.torch.load_file(run / "adapter" / "adapter_model.safetensors")
    trained = {k.replace(".default.", "."): v for k, v in serial.state_dict().items() if ".lora_" in k}
    head = {  # the head's trained copy, under the head's plain name
        k.replace(".modules_to_save.default.", "."): v
        for k, v in serial.state_dict().items()
        if ".modules_to_save." in k
    }
    assert head, "the head is trained whole"
    torch.testing.assert_close(saved, {**trained, **head}, rtol=1e-5, atol=1e-6)

    ids = torch.tensor([[5, 17, 33, 8, 90, 4, 61, 12]])
    expected = serial(ids).logits.detach()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, run / "adapter")
    torch.testing.assert_close(
        loaded(ids).logits, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"adapter: {m}"
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32)
    torch.testing.assert_close(
        merged(ids).logits, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"merged: {m}"
    )
    assert load_tokenizer(run / "merged").encode("hello fox") == load_tokenizer(model_dir).encode("hello fox")

    # SLURM started the job again (a requeue) after its generation at step 2: the command goes
    # on in its run folder from there (the generation at step 4 torn: its manifest gone)
    (run / "checkpoint" / "step-00000004" / MANIFEST).unlink()
    requeue = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODEID": "0"}
    resumed, again = _launch(tmp_path, "tuned", *sources, env={**requeue, "SLURM_RESTART_COUNT": "1"})
    assert again == run
    assert resumed == losses  # steps 0-1 kept in metrics.jsonl, 2-3 trained again
    torch.testing.assert_close(
        safetensors.torch.load_file(again / "adapter" / "adapter_model.safetensors"), saved, rtol=0, atol=0
    )


def test_mistakes_in_finetune_are_one_line_before_spawning(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "finetune", "--nproc-per-node", "2"]
    missing = [
        f"finetune.model={tmp_path / 'nowhere'}",
        f"finetune.data={tmp_path / 'x.txt'}",
        "train.verify=true",
    ]
    proc = subprocess.run(
        [*cmd, *[a for s in [*SETS, *missing] for a in ("--set", s)]],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"finetune.model={tmp_path / 'nowhere'}: no config.json there" in proc.stderr
    assert f"finetune.data={tmp_path / 'x.txt'}: not a .jsonl file" in proc.stderr
    assert "train.verify: tessera finetune builds its model without values" in proc.stderr
    assert not (tmp_path / "runs").exists()
