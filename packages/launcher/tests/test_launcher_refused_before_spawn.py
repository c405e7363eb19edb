"""Text that is not text, and checkpoints that cannot be resumed, refused by ``tessera train``
before anything spawns: exit code 2, one line naming the file (and the byte offset, or what
differs), nothing written (no run folder, no prepared data).

Each refusal runs ``cli.main`` in this process, as the mistakes tests do, with the spawner
replaced by a failure. The checkpoints are real: one ``tessera train`` of a tiny model (one
process, marked slow) saves a generation that the tests then copy and damage. A resume that
can work, under another layout or on several nodes whose folders are not shared, is not refused,
and it goes on in the run folder that holds its checkpoint unless ``train.name`` names another.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.launcher.config.config_io import resolve_config
from tessera.launcher.run import cli
from tessera.launcher.run.preflight import preflight
from tessera.launcher.run.runs import create_run_folder

TINY = ["parallel.dp=1", "model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4",
        "data.max_chars=20000", "optim.warmup_steps=1", "train.eval_every=1000",
        "train.sample_chars=4"]  # fmt: skip


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _refused(
    argv: list[str], where: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """Run ``tessera`` ``argv`` in ``where``: it must refuse with one line and write nothing there."""
    before = _listing(where)
    monkeypatch.chdir(where)
    for key in [k for k in os.environ if k.startswith("TESSERA_")]:
        monkeypatch.delenv(key)

    def spawn(*args: object, **kwargs: object) -> int:
        raise AssertionError("a refused job spawned")

    monkeypatch.setattr(cli, "spawn", spawn)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("tessera: "), err
    assert _listing(where) == before, "a refused job wrote something"
    return lines[0]


# ------------------------------------------------------------------------------ text that is not text
NOT_TEXT = {
    "random bytes": (os.urandom(4096), "is not UTF-8 text: byte offset"),
    "utf-16": ("def f():\n    return 1\n".encode("utf-16-le") * 50, "byte offset 1 is a NUL byte"),
    "latin-1 after text": (b"plain text\n" * 20 + "caf\xe9\n".encode("latin-1"), "byte offset 223 (0xe9)"),
    "control characters": (b"ab\x01\x02\x03\x04" * 200, "67% of its bytes are control characters"),
}


@pytest.mark.parametrize("field", ["data.corpus", "data.path"])
@pytest.mark.parametrize("name", list(NOT_TEXT))
def test_a_file_that_is_not_text_is_refused_naming_the_offset(
    name: str, field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder of sources with one file that is not text among text files (``data.corpus``
    reads the folder's .py and .txt files, ``data.path`` its .txt files)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"good-{i}.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    content, expected = NOT_TEXT[name]
    (data / "notes.txt").write_bytes(content)
    line = _refused(["train", *_sets([*TINY, f"{field}={data}"])], tmp_path, monkeypatch, capsys)
    assert f"{data / 'notes.txt'}" in line and expected in line, line
    if name == "control characters":
        assert "(the first at byte offset 2)" in line, line


def test_text_with_form_feeds_escapes_and_accents_is_text(tmp_path: Path) -> None:
    """No false alarm: what real text holds (form feeds in Python sources, colour escapes in
    logs, tabs, CRLF, a BOM, characters beyond ASCII) passes, in blocks cut mid-character."""
    from tessera.launcher.data import text_check

    text = "\ufeffcafé naïve — 漢字 🙂\r\n\tx = 1\x0c\n\x1b[31mred\x1b[0m\n" * 5000
    (tmp_path / "ok.txt").write_text(text, encoding="utf-8")
    assert text_check.text_problem(tmp_path / "ok.txt", "data.path") is None
    assert text_check.read_text(tmp_path / "ok.txt", "data.corpus") == text


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose checkpoint holds one generation, saved by a real ``tessera train``."""
    where = tmp_path_factory.mktemp("saved")
    cmd = [
        sys.executable,
        "-m",
        "tessera.launcher.run.cli",
        "train",
        *_sets([*TINY, "train.steps=2", "train.name=a"]),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    proc = subprocess.run(
        cmd, cwd=where, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "runs" / "a" / "checkpoint"


def _copy(saved: Path, tmp_path: Path) -> Path:
    """The saved checkpoint, copied into ``tmp_path/ckpt``; its generation's directory."""
    shutil.copytree(saved, tmp_path / "ckpt")
    (generation,) = (tmp_path / "ckpt").glob("step-*")
    return generation


def _resume(tmp_path: Path, *sets: str) -> list[str]:
    return ["train", *_sets([*TINY, f"train.resume={tmp_path / 'ckpt'}", *sets])]


@pytest.mark.slow
def test_a_truncated_or_flipped_checkpoint_file_is_refused_naming_it(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    generation = _copy(saved, tmp_path)
    victim = generation / "rank-00000.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # cut short
    line = _refused(_resume(tmp_path), tmp_path, monkeypatch, capsys)
    assert f"{victim} does not match its checksum in manifest.json" in line, line
    flipped = bytearray(data)
    flipped[len(data) - 10] ^= 0x40  # one bit of one weight
    victim.write_bytes(bytes(flipped))
    line = _refused(_resume(tmp_path), tmp_path, monkeypatch, capsys)
    assert f"{victim} does not match its checksum in manifest.json" in line, line
    victim.unlink()
    line = _refused(_resume(tmp_path), tmp_path, monkeypatch, capsys)
    assert f"{victim} is missing (listed in its manifest.json)" in line, line


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_naming_the_numbers(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    generation = _copy(saved, tmp_path)
    line = _refused(_resume(tmp_path, "model.d_model=64"), tmp_path, monkeypatch, capsys)
    assert line == (
        f"tessera: train.resume={str(tmp_path / 'ckpt')!r}: {generation} was saved under another "
        "configuration: model.d_model: saved 32, now 64"
    )
    line = _refused(_resume(tmp_path, "optim.name=sgd"), tmp_path, monkeypatch, capsys)
    assert "optim.name: saved 'adamw', now 'sgd'" in line, line


@pytest.mark.slow
def test_a_resume_that_can_work_is_not_refused(saved: Path, tmp_path: Path) -> None:
    """The generation as saved; under another layout, which reshards (the degrees and ZeRO may
    change); on several nodes, where a file this node lacks may be on another node's disk
    (folders that are not shared)."""
    generation = _copy(saved, tmp_path)
    assert json.loads((generation / "manifest.json").read_text())["config"]["model"]["d_model"] == 32
    resume = [*TINY, f"train.run_dir={tmp_path / 'runs'}", f"train.resume={tmp_path / 'ckpt'}"]
    assert preflight(resolve_config(None, resume), main_job=True) == []
    other = resolve_config(None, [*resume, "parallel.dp=2", "parallel.microbatches=2", "zero.stage=1"])
    assert preflight(other, main_job=True) == []
    (generation / "rank-00000.safetensors").unlink()
    config = resolve_config(None, resume)
    assert preflight(config, main_job=True, nodes=2) == []
    assert len(preflight(config, main_job=True, nodes=1)) == 1


def test_a_seq_len_longer_than_the_validation_split_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The built-in corpus's validation split is its last ``data.val_fraction``: 20,000
    characters at 0.05 leave 1,000, too few for a row of 2,000."""
    line = _refused(["train", *_sets([*TINY, "model.seq_len=2000"])], tmp_path, monkeypatch, capsys)
    assert line == (
        "tessera: data.corpus='stdlib': the val split has 1000 tokens (of 20000, data.val_fraction=0.05), "
        "too few for model.seq_len=2000"
    )


def test_a_resume_goes_on_in_the_folder_that_holds_its_checkpoint(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = runs / "char-gpt-20260101-000000"
    (run / "checkpoint" / "step-00000004").mkdir(parents=True)
    for resume in (run / "checkpoint", run / "checkpoint" / "step-00000004"):
        config = resolve_config(None, [f"train.run_dir={runs}", f"train.resume={resume}"])
        assert create_run_folder(config) == run
    told = resolve_config(
        None, [f"train.run_dir={runs}", "train.name=fork", f"train.resume={run / 'checkpoint'}"]
    )
    assert create_run_folder(told) == runs / "fork"
    (tmp_path / "elsewhere").mkdir()
    other = resolve_config(None, [f"train.run_dir={runs}", f"train.resume={tmp_path / 'elsewhere'}"])
    made = create_run_folder(other)
    assert made.parent == runs and made.name.startswith("char-gpt-") and made != run
