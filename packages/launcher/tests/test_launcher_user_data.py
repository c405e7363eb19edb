"""The main job on the user's own data (``data.path``): files, tokenizers, shards, batches,
refusals before spawning, each kind of data end to end, and a resume at the exact next sample.

Tiers 0-1 (no processes) except ``test_each_kind_trains_end_to_end`` (the main job in this
process, world size 1, after the launcher's checks and preparation) and the resume test
(``tessera train`` with 2 processes, marked slow).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tessera.launcher.config import Config
from tessera.launcher.config.config_io import RESOLVED_ENV, RUN_FOLDER_ENV, config_to_dict, resolve_config
from tessera.launcher.data import text_tokenizers
from tessera.launcher.data.data_sources import source_files
from tessera.launcher.data.prepare import ensure_prepared, open_tokens, prepare, prepared_dir
from tessera.launcher.data.text_tokenizers import ByteVocab, CharVocab, HFTokenizer, from_record
from tessera.launcher.data.token_data import TokenData
from tessera.launcher.job import runlog
from tessera.launcher.run import cli
from tessera.launcher.run.preflight import preflight

WORDS = ["def", "return", "self", "value", "the", "quick", "brown", "fox", "lazy", "dog", "naïve", "café"]
TINY = [
    "parallel.dp=1",
    "parallel.microbatches=1",
    "model.seq_len=8",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "data.batch_size=4",
    "train.eval_batches=1",
    "train.sample_chars=12",
]


def _text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n_words // 8)]
    return "\n".join(lines) + "\n"


def _config(tmp: Path, *sets: str) -> Config:
    return resolve_config(None, [*TINY, f"train.run_dir={tmp / 'runs'}", *sets])


def _hf_tokenizer(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers", reason="the optional tokenizers package is absent")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_text(400, s) for s in range(4)], trainer)
    tok.save(str(path))
    return path


# ---------------------------------------------------------------- tokenizers, files, shards


def test_tokenizers_round_trip(tmp_path: Path) -> None:
    text = _text(64) + "ü → 𝛑\n"
    char = CharVocab.fit([text])
    assert char.decode(char.encode(text).tolist()) == text
    assert from_record(char.record()).encode(text).tolist() == char.encode(text).tolist()
    with pytest.raises(ValueError, match="'Z' is not in the vocabulary"):
        char.encode("aZ")
    byte = ByteVocab()
    assert byte.decode(byte.encode(text).tolist()) == text and int(byte.encode(text).max()) < 256
    hf = HFTokenizer(str(_hf_tokenizer(tmp_path / "tokenizer.json")))
    ids = hf.encode(text[:200])
    assert hf.decode(ids.tolist()) == text[:200] and int(ids.max()) < hf.vocab_size <= 300


def test_source_files_file_folder_glob(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.txt", "d/sub/a.jsonl", "d/c.txt", "d/skip.md"):
        (tmp_path / name).write_text("x\n" if name.endswith("txt") else '{"text": "x"}\n')
    d = tmp_path / "d"
    assert source_files(str(d / "b.txt")) == [d / "b.txt"]
    assert source_files(str(d)) == [d / "b.txt", d / "c.txt", d / "sub" / "a.jsonl"]
    assert source_files(str(d / "*.txt")) == [d / "b.txt", d / "c.txt"]
    assert source_files(str(d / "**" / "*.jsonl")) == [d / "sub" / "a.jsonl"]
    assert source_files(str(tmp_path / "d*")) == source_files(str(d))  # a matched folder's files
    (d / "t.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="mixes token files"):
        source_files(str(d))


def test_prepare_writes_shards_that_read_back_as_one_stream(tmp_path: Path) -> None:
    docs = [_text(40, s) for s in range(5)]
    with (tmp_path / "docs.jsonl").open("w") as f:
        for d in docs:
            f.write(json.dumps({"body": d.rstrip("\n"), "id": 1}) + "\n\n")
    config = _config(tmp_path, f"data.path={tmp_path / 'docs.jsonl'}", "data.field=body")
    meta = prepare(config, shard_tokens=100)
    assert len(meta["shards"]) > 3 and meta["documents"] == 5 and meta["dtype"] == "uint16"
    assert json.loads((prepared_dir(config) / "meta.json").read_text()) == meta
    data = TokenData(open_tokens(config), val_fraction=0.1, seq_len=8, seed=0)
    tok = CharVocab.fit(docs)
    assert data.tokens == meta["tokens"] == sum(len(d) for d in docs)
    assert data.tokenizer.decode(data.read(0, data.tokens).tolist()) == "".join(docs)  # across shards
    assert tok.chars == data.tokenizer.record()["chars"]
    (tmp_path / "docs.jsonl").write_text('{"body": "changed"}\n')
    with pytest.raises(ValueError, match="stale\\): run tessera prepare-data"):
        open_tokens(config)


def test_batches_shuffle_by_seed_and_epoch_and_split_by_rows(tmp_path: Path) -> None:
    ids = np.arange(1, 402, dtype=np.uint16) % 50
    ids.tofile(tmp_path / "t.bin")
    config = _config(
        tmp_path, f"data.path={tmp_path / 't.bin'}", "data.token_dtype=uint16", "model.vocab_size=50"
    )
    data = TokenData(open_tokens(config), val_fraction=0.2, seq_len=8, seed=3)
    n = data.samples["train"]
    assert n == (320 - 1) // 8
    bs = 5
    seen = [i for step in range(n) for i in data.sample_indices("train", step, bs)]  # n steps = bs epochs
    for epoch in range(bs):
        assert sorted(seen[epoch * n : (epoch + 1) * n]) == list(range(n))  # each sample once an epoch
    assert seen[:n] != seen[n : 2 * n]  # another order each epoch
    x, y = data.batch("train", 7, bs)
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64
    for r, k in enumerate(data.sample_indices("train", 7, bs)):
        assert x[r].tolist() == ids[k * 8 : k * 8 + 8].tolist()
    again = TokenData(open_tokens(config), val_fraction=0.2, seq_len=8, seed=3)
    assert torch.equal(again.batch("train", 7, bs)[0], x)  # a function of (seed, step)
    other = TokenData(open_tokens(config), val_fraction=0.2, seq_len=8, seed=4)
    assert not torch.equal(other.batch("train", 7, bs)[0], x)
    replica = data.batch("train", 7, 4, rows=range(2, 4))  # dp replica 1 of 2 reads only its rows
    assert torch.equal(replica[0], data.batch("train", 7, 4)[0][2:4])
    vx, _ = data.batch("val", 0, 2)
    assert int(vx.min()) >= 0 and data.bounds["val"] == (320, 401)


def test_token_files_take_the_sidecar(tmp_path: Path) -> None:
    ids = (np.arange(3000, dtype=np.uint32) * 7919) % 70_000
    (tmp_path / "tok").mkdir()
    ids[:1500].tofile(tmp_path / "tok" / "a.bin")
    ids[1500:].tofile(tmp_path / "tok" / "b.bin")
    (tmp_path / "tok" / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70_000}))
    config = _config(tmp_path, f"data.path={tmp_path / 'tok'}")
    assert preflight(config, main_job=True) == []
    data = TokenData(open_tokens(config), val_fraction=0.1, seq_len=8, seed=0)
    assert data.vocab_size == 70_000 and data.read(1495, 10).tolist() == ids[1495:1505].tolist()


# ---------------------------------------------------------------- refusals before spawning

FILES = {
    "good.txt": _text(400),
    "empty.txt": "",
    "nofield.jsonl": '{"text": "a"}\n{"text": "b"}\n{"title": "c"}\n',
    "notjson.jsonl": '{"text": "a"}\nnot json\n',
    "number.jsonl": '{"text": 5}\n',
    "blank.jsonl": "\n\n",
    "empty/readme.md": "not data",
    "mixed/a.txt": "some text\n",
    "mixed/b.txt": "",
    "odd.bin": "abc",
}


def _scratch(d: Path) -> None:
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (np.arange(200, dtype=np.uint16) % 40).tofile(d / "ok.bin")
    big = np.arange(200, dtype=np.uint16) % 40
    big[123] = 40
    big.tofile(d / "big.bin")
    np.zeros(20, dtype=np.uint16).tofile(d / "short.bin")
    (d / "tok.json").write_text("{}")
    (d / "sidecar").mkdir()
    (np.arange(200, dtype=np.uint16) % 40).tofile(d / "sidecar" / "ids.bin")  # ids up to 39
    (d / "sidecar" / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 39}))


CASES = {
    "missing path": (["data.path={d}/nope.txt"], ["data.path=", "nope.txt", "does not exist"]),
    "no match": (["data.path={d}/*.parquet"], ["*.parquet", "matches no .txt, .jsonl or .bin files"]),
    "folder no files": (["data.path={d}/empty"], ["empty", "a folder with no"]),
    "empty file": (["data.path={d}/empty.txt"], ["empty.txt is empty"]),
    "empty file in a folder": (["data.path={d}/mixed"], ["mixed/b.txt is empty"]),
    "no field": (["data.path={d}/nofield.jsonl"], ["nofield.jsonl line 3 has no field 'text'"]),
    "not json": (["data.path={d}/notjson.jsonl"], ["notjson.jsonl line 2 is not JSON"]),
    "not a string": (["data.path={d}/number.jsonl"], ["number.jsonl line 1", "is a int, not a string"]),
    "no lines": (["data.path={d}/blank.jsonl"], ["blank.jsonl holds no JSON lines"]),
    "id too big": (
        ["data.path={d}/big.bin", "data.token_dtype=uint16", "model.vocab_size=40"],
        ["big.bin token 123 (byte offset 246) is id 40", "vocabulary size 40"],
    ),
    "id too big for meta.json": (
        ["data.path={d}/sidecar"],
        ["sidecar/ids.bin token 39 (byte offset 78) is id 39", "vocabulary size 39"],
    ),
    "validation split too short": (
        ["data.path={d}/ok.bin", "data.token_dtype=uint16", "data.tokenizer=byte", "data.val_fraction=0.01"],
        ["the val split has 2 tokens (of 200, data.val_fraction=0.01)", "model.seq_len=8"],
    ),
    "odd bytes": (
        ["data.path={d}/odd.bin", "data.token_dtype=uint16", "data.tokenizer=byte"],
        ["odd.bin holds 3 bytes, not a whole number of uint16 tokens"],
    ),
    "dtype unknown": (["data.path={d}/ok.bin"], ["dtype is unknown", "data.token_dtype"]),
    "bad dtype": (["data.path={d}/ok.bin", "data.token_dtype=int8"], ["data.token_dtype='int8'"]),
    "vocab unknown": (["data.path={d}/ok.bin", "data.token_dtype=uint16"], ["model.vocab_size", "meta.json"]),
    "too short": (
        [
            "data.path={d}/short.bin",
            "data.token_dtype=uint16",
            "data.tokenizer=byte",
            "data.val_fraction=0.6",
        ],
        ["the train split has 8 tokens (of 20, data.val_fraction=0.6)", "model.seq_len=8"],
    ),
    "vocab small": (
        ["data.path={d}/ok.bin", "data.token_dtype=uint16", "data.tokenizer=byte", "model.vocab_size=100"],
        ["model.vocab_size=100 is smaller than the 256 ids"],
    ),
    "unknown tokenizer": (["data.path={d}/good.txt", "data.tokenizer=words"], ["data.tokenizer='words'"]),
    "bad tokenizer file": (["data.path={d}/good.txt", "data.tokenizer={d}/tok.json"], ["tok.json'"]),
}


def _argv(command: str, name: str, d: Path) -> list[str]:
    argv = [command]
    for s in [*TINY, f"train.run_dir={d}/runs", *CASES[name][0]]:
        argv += ["--set", s.replace("{d}", str(d))]
    return argv


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.mark.parametrize("command", ["train", "prepare-data"])
@pytest.mark.parametrize("name", list(CASES))
def test_bad_data_is_refused_in_one_line_before_spawning(
    name: str,
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _scratch(tmp_path)
    before = _listing(tmp_path)

    def spawn(*args: object, **kwargs: object) -> int:
        raise AssertionError("a refused job spawned")

    monkeypatch.setattr(cli, "spawn", spawn)
    assert cli.main(_argv(command, name, tmp_path)) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("tessera: "), err
    for part in CASES[name][1]:
        assert part in lines[0], lines[0]
    assert _listing(tmp_path) == before, "a refused job wrote something"


def test_a_tokenizer_json_without_the_package_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _scratch(tmp_path)
    monkeypatch.setattr(text_tokenizers, "have_tokenizers", lambda: False)
    sets = [*TINY, f"data.path={tmp_path}/good.txt", f"data.tokenizer={tmp_path}/tok.json"]
    assert cli.main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    assert "needs the optional 'tokenizers' package: pip install tokenizers" in capsys.readouterr().err


def test_no_data_refusal_imports_torch(tmp_path: Path) -> None:
    _scratch(tmp_path)
    child = (
        "import contextlib, io, json, sys\n"
        "from tessera.launcher.run.cli import main\n"
        "codes = []\n"
        "for argv in json.load(sys.stdin):\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        codes.append(main(argv))\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}))\n"
    )
    cases = [_argv("train", name, tmp_path) for name in CASES]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    proc = subprocess.run(
        [sys.executable, "-c", child], input=json.dumps(cases), capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report == {"codes": [2] * len(CASES), "torch": False}


def test_prepare_data_reports_progress_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text(_text(300))
    sets = [*TINY, f"train.run_dir={tmp_path}/runs", f"data.path={tmp_path}/a.txt", "data.tokenizer=byte"]
    assert cli.main(["prepare-data", *[a for s in sets for a in ("--set", s)]]) == 0
    err = capsys.readouterr().err
    assert "tessera: prepare-data: 1/1 files, 1 documents" in err and "tessera: prepared" in err
    assert len(list((tmp_path / "runs" / "data").glob("*/tokens-00000.bin"))) == 1


# ---------------------------------------------------------------- the main job, each kind


def _train_here(config: Config, run: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The launcher's checks and preparation, then the main job in this process (world 1)."""
    from tessera.launcher.job import main_job

    assert preflight(config, main_job=True) == []
    assert ensure_prepared(config, lambda line: None) == []
    resolved = run.parent / f"{run.name}.json"
    resolved.write_text(json.dumps(config_to_dict(config)))
    run.mkdir(parents=True)
    monkeypatch.setenv(RESOLVED_ENV, str(resolved))
    monkeypatch.setenv(RUN_FOLDER_ENV, str(run))
    store = dist.FileStore(str(run.parent / f"{run.name}.store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        main_job.main()  # destroys the process group at its end
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _kinds(d: Path) -> dict[str, list[str]]:
    (d / "a.txt").write_text(_text(600, 1))
    (d / "docs").mkdir()
    with (d / "docs" / "part-0.jsonl").open("w") as f:
        for s in range(6):
            f.write(json.dumps({"text": _text(80, s)}) + "\n")
    (d / "docs" / "part-1.txt").write_text(_text(200, 9))
    (np.arange(2000, dtype=np.uint16) * 31 % 97).tofile(d / "ids.bin")
    kinds = {
        "txt, char": ["data.path={d}/a.txt"],
        "jsonl + txt folder, byte": ["data.path={d}/docs", "data.tokenizer=byte"],
        "glob, char": ["data.path={d}/docs/*.jsonl"],
        "bin, uint16, vocab from the config": [
            "data.path={d}/ids.bin",
            "data.token_dtype=uint16",
            "model.vocab_size=97",
        ],
    }
    if text_tokenizers.have_tokenizers():
        kinds["txt, tokenizer.json"] = [
            "data.path={d}/a.txt",
            f"data.tokenizer={_hf_tokenizer(d / 'tok.json')}",
        ]
    return {k: [s.replace("{d}", str(d)) for s in v] for k, v in kinds.items()}


def _board_losses(run: Path) -> list[tuple[int, float]]:
    """The ``train/loss`` scalars of the run's TensorBoard event files: (step, value)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_each_kind_trains_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not text_tokenizers.have_tokenizers():
        print("SKIPPED the tokenizer.json kind: the optional tokenizers package is absent")
    if not runlog.have_tensorboard():
        print("SKIPPED the TensorBoard event files: the optional tensorboard package is absent")
    for i, (kind, sets) in enumerate(_kinds(tmp_path).items()):
        config = _config(tmp_path, *sets, "train.steps=6", "train.log_every=3", "train.eval_every=6")
        run = tmp_path / f"run-{i}"
        records = _train_here(config, run, monkeypatch)
        losses = [r["loss"] for r in records if "loss" in r]
        assert len(losses) == 2 and all(isinstance(x, float) and x == x for x in losses), kind
        assert any("val_loss" in r for r in records), kind
        assert (run / "model.safetensors").is_file() and (run / "tokenizer.json").read_text(), kind
        assert len((run / "sample.txt").read_text()) > 0, kind
        manifest = json.loads((run / "checkpoint" / "step-00000006" / "manifest.json").read_text())
        assert manifest["data_position"] == 6 and manifest["config"]["data"]["path"] == config.data.path
        if runlog.have_tensorboard():  # the same losses, as float32 (TensorBoard's scalars)
            steps = [(r["step"], float(np.float32(r["loss"]))) for r in records if "loss" in r]
            assert _board_losses(run) == steps, kind
        else:
            assert not (run / "tensorboard").exists()


# ---------------------------------------------------------------- resume at the exact next sample


@pytest.mark.slow
def test_resume_continues_at_the_exact_next_sample(tmp_path: Path) -> None:
    """40 steps straight = 20 steps, then a resume for 20 more: the same loss at every step,
    bit for bit (2 processes, dp=2 with ZeRO-1: each replica trains its 2 rows of the batch of
    4; a constant learning rate, so the 20-step run's schedule is the 40-step run's). The
    data holds 87 training samples, so the resume starts at sample 80 of epoch 0 and crosses
    into epoch 1's order two steps later."""
    with (tmp_path / "docs.jsonl").open("w") as f:
        for s in range(3):
            f.write(json.dumps({"text": _text(48, s)}) + "\n")
    base = [
        *TINY,
        "parallel.dp=2",
        "zero.stage=1",
        f"data.path={tmp_path / 'docs.jsonl'}",
        "optim.warmup_steps=0",
        "optim.min_lr_ratio=1.0",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.sample_chars=4",
    ]

    def train(*sets: str) -> tuple[list[float], str]:
        cmd = [sys.executable, "-m", "tessera.launcher.run.cli", "train"]
        for s in [*base, *sets]:
            cmd += ["--set", s]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        name = dict(s.split("=", 1) for s in sets)["train.name"]
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r], proc.stdout + proc.stderr

    straight, _ = train("train.steps=40", "train.name=straight")
    first, _ = train("train.steps=20", "train.name=first")
    resumed, log = train("train.steps=40", "train.name=second", "train.resume=runs/first/checkpoint")
    assert "data position: step 20 = epoch 0, sample 80 of 87" in log
    assert len(straight) == 40 and len(resumed) == 20
    assert first == straight[:20]
    assert resumed == straight[20:]  # bit for bit: the same samples, in the same order
    if runlog.have_tensorboard():  # rank 0 alone writes event files
        for name in ("straight", "first", "second"):
            assert len(list((tmp_path / "runs" / name / "tensorboard").glob("events.*"))) == 1, name
