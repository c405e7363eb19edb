"""Tier 0-1: 77 configuration and usage mistakes, each refused by ``tessera`` before anything
spawns: exit code 2 and one line naming the field (or flag) and the value.

Each case runs ``cli.main`` in this process with the spawner replaced by a failure, and the
folder it may write into checked afterwards. One subprocess then runs every case in a fresh
interpreter and checks that torch was never imported, which is what keeps a refusal under
a second or two; it prints each case's time (measured, not asserted). That subprocess
imports the launcher's modules without the package ``__init__`` (which imports ``boost``
and so torch, for the package's users); the ``tessera`` command itself is as fast once that
``__init__`` loads ``boost`` and the Engine lazily.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.launcher.run import cli

ONE = ["parallel.dp=2"]


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


# id: (command line, environment, what the one line must contain); {d} is a scratch folder
ELASTIC = ["run", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29500"]
CASES: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
    "nproc 0": (["run", "--nproc-per-node", "0", "job.py"], {}, ["--nproc-per-node", "got 0"]),
    "nproc -1": (["run", "--nproc-per-node", "-1", "job.py"], {}, ["--nproc-per-node", "got -1"]),
    "nproc != world": (
        ["run", "--nproc-per-node", "3", "--set", *ONE, "job.py"],
        {},
        ["--nproc-per-node 3", "pp*dp*cp*tp = 1*2*1*1 = 2"],
    ),
    "nnodes 0": (["run", "--nnodes", "0", "job.py"], {}, ["--nnodes", "got 0"]),
    "nnodes 2 no endpoint": (["run", "--nnodes", "2", "job.py"], {}, ["--nnodes 2", "--rdzv-endpoint"]),
    "ssh without a hostfile": (["run", "--ssh", "job.py"], {}, ["--ssh starts the hosts of a hostfile"]),
    "nnodes max < min": (["run", "--nnodes", "3:2", "job.py"], {}, ["--nnodes 3:2", "got MIN 3 and MAX 2"]),
    "nnodes not a number": (["run", "--nnodes", "two", "job.py"], {}, ["--nnodes 'two'", "N or MIN:MAX"]),
    "elastic world too small": (
        [*ELASTIC, "--set", "parallel.tp=2", "job.py"],
        {},
        ["--nnodes 1:2: at 1 processes", "replicas of tp * pp * cp = 2 * 1 * 1 = 2"],
    ),
    "node rank": (
        ["run", "--nnodes", "2", "--node-rank", "3", "--rdzv-endpoint", "h0:29500", "job.py"],
        {},
        ["node rank 3", "[0, 2)"],
    ),
    "endpoint no port": (
        ["run", "--rdzv-endpoint", "127.0.0.1", "job.py"],
        {},
        ["--rdzv-endpoint", "127.0.0.1"],
    ),
    "endpoint port": (["run", "--rdzv-endpoint", "h:99999", "job.py"], {}, ["--rdzv-endpoint", "h:99999"]),
    "hostfile missing": (["run", "--hostfile", "{d}/nohosts", "job.py"], {}, ["--hostfile", "nohosts"]),
    "hostfile dir": (["run", "--hostfile", "{d}", "job.py"], {}, ["--hostfile", "cannot be read"]),
    "hostfile empty": (["run", "--hostfile", "{d}/empty", "job.py"], {}, ["hostfile", "lists no hosts"]),
    "hostfile line": (["run", "--hostfile", "{d}/badhosts", "job.py"], {}, ["badhosts:1", "slots=x"]),
    "script missing": (["run", "nope.py"], {}, ["script", "nope.py"]),
    "no script": (["run"], {}, ["exactly one of"]),
    "dp 0": (["run", "--set", "parallel.dp=0", "job.py"], {}, ["parallel.dp", "got 0"]),
    "ep 0": (["run", *_sets("parallel.dp=2", "parallel.ep=0"), "job.py"], {}, ["parallel.ep", "got 0"]),
    "ep not dividing dp": (
        ["run", *_sets("parallel.dp=4", "parallel.ep=3"), "job.py"],
        {},
        ["parallel.ep=3 must divide parallel.dp=4"],
    ),
    "ep with cp": (
        ["run", *_sets("parallel.dp=2", "parallel.ep=2", "parallel.cp=2"), "job.py"],
        {},
        ["parallel.ep=2 with parallel.cp=2"],
    ),
    "moe top_k > experts": (
        ["train", *_sets("moe.enabled=true", "moe.experts=4", "moe.top_k=5")],
        {},
        ["moe.top_k=5 is more than moe.experts=4"],
    ),
    "moe capacity 0": (
        ["train", *_sets("moe.enabled=true", "moe.capacity_factor=0")],
        {},
        ["moe.capacity_factor=0.0 must be > 0"],
    ),
    "ep without moe": (
        ["train", *_sets("parallel.dp=2", "parallel.ep=2")],
        {},
        ["parallel.ep=2 needs moe.enabled"],
    ),
    "chunk working set": (
        ["run", *_sets("zero.host_budget_mb=1", "zero.chunk_numel=65536", "zero.disk_dir={d}"), "job.py"],
        {},
        ["zero.host_budget_mb=1 cannot hold the chunk manager's working set", "= 1.5 MiB"],
    ),
    "tp -1": (["run", "--set", "parallel.tp=-1", "job.py"], {}, ["parallel.tp", "got -1"]),
    "schedule": (["run", "--set", "parallel.schedule=zbx", "job.py"], {}, ["parallel.schedule", "zbx"]),
    "interleaved m<p": (
        [
            "run",
            *_sets("parallel.pp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2"),
            *_sets("parallel.microbatches=1"),
            "job.py",
        ],
        {},
        ["pp=2", "microbatches=1"],
    ),
    "cp mode": (
        ["run", *_sets("parallel.cp=2", "parallel.cp_mode=tree"), "job.py"],
        {},
        ["parallel.cp_mode='tree'"],
    ),
    "batch": (["train", "--set", "parallel.dp=3"], {}, ["data.batch_size=16", "parallel.dp"]),
    "heads": (["train", "--set", "model.d_model=30"], {}, ["model.d_model=30", "model.n_heads=4"]),
    "blocks": (
        ["train", *_sets("parallel.pp=8", "parallel.microbatches=8", "data.batch_size=16")],
        {},
        ["model.n_layers=4", "parallel.pp"],
    ),
    "zero 4": (["run", "--set", "zero.stage=4", "job.py"], {}, ["zero.stage=4"]),
    "zero -1": (["run", "--set", "zero.stage=-1", "job.py"], {}, ["zero.stage", "got -1"]),
    "precision": (["run", "--set", "train.precision=fp8", "job.py"], {}, ["train.precision", "fp8"]),
    "optimizer": (["run", "--set", "optim.name=lamb", "job.py"], {}, ["optim.name", "lamb"]),
    "lr 0": (["run", "--set", "optim.lr=0", "job.py"], {}, ["optim.lr=0.0"]),
    "lr negative": (["run", "--set", "optim.lr=-0.001", "job.py"], {}, ["optim.lr=-0.001"]),
    "lr nan": (["run", "--set", "optim.lr=nan", "job.py"], {}, ["optim.lr=nan", "finite"]),
    "lr inf": (["run", "--set", "optim.lr=inf", "job.py"], {}, ["optim.lr=inf", "finite"]),
    "dropout": (["train", "--set", "model.dropout=1.5"], {}, ["model.dropout=1.5"]),
    "val fraction": (["train", "--set", "data.val_fraction=0"], {}, ["data.val_fraction=0.0"]),
    "log level": (["run", "--set", "logging.level=loud", "job.py"], {}, ["logging.level", "loud"]),
    "watchdog": (["run", "--set", "train.watchdog_s=-1", "job.py"], {}, ["train.watchdog_s=-1.0"]),
    "seed": (["run", "--set", "train.seed=-1", "job.py"], {}, ["train.seed", "got -1"]),
    "vocab -1": (["run", "--set", "model.vocab_size=-1", "job.py"], {}, ["model.vocab_size", "got -1"]),
    "max chars": (["run", "--set", "data.max_chars=0", "job.py"], {}, ["data.max_chars", "got 0"]),
    "text int": (["run", "--set", "train.steps=ten", "job.py"], {}, ["train.steps", "ten"]),
    "float for int": (["run", "--set", "train.steps=2.5", "job.py"], {}, ["train.steps", "2.5"]),
    "text bool": (
        ["run", "--set", "parallel.sequence_parallel=maybe", "job.py"],
        {},
        ["sequence_parallel", "maybe"],
    ),
    "unknown field": (["run", "--set", "train.stepz=1", "job.py"], {}, ["train.stepz"]),
    "unknown section": (["run", "--set", "trian.steps=1", "job.py"], {}, ["trian"]),
    "malformed set": (["run", "--set", "steps=1", "job.py"], {}, ["steps=1", "section.field=value"]),
    "toml str int": (["run", "--config", "{d}/str.toml", "job.py"], {}, ["parallel.dp='2'", "str"]),
    "toml float int": (["run", "--config", "{d}/float.toml", "job.py"], {}, ["train.steps=2.0", "float"]),
    "toml bool int": (["run", "--config", "{d}/bool.toml", "job.py"], {}, ["train.steps=True", "bool"]),
    "toml str float": (["run", "--config", "{d}/lr.toml", "job.py"], {}, ["optim.lr='fast'", "str"]),
    "toml int bool": (
        ["run", "--config", "{d}/cp.toml", "job.py"],
        {},
        ["parallel.sequence_parallel=1", "int"],
    ),
    "toml top key": (["run", "--config", "{d}/top.toml", "job.py"], {}, ["top-level key 'steps'"]),
    "toml syntax": (["run", "--config", "{d}/broken.toml", "job.py"], {}, ["broken.toml", "not valid TOML"]),
    "toml missing": (["run", "--config", "{d}/none.toml", "job.py"], {}, ["none.toml", "does not exist"]),
    "env misspelt": (["run", "job.py"], {"TESSERA_PARALEL_DP": "4"}, ["TESSERA_PARALEL_DP", "'4'"]),
    "env unknown field": (["run", "job.py"], {"TESSERA_TRAIN_STPES": "3"}, ["train.stpes"]),
    "env text int": (["run", "job.py"], {"TESSERA_TRAIN_STEPS": "abc"}, ["train.steps", "abc"]),
    "env dp 0": (["run", "job.py"], {"TESSERA_PARALLEL_DP": "0"}, ["parallel.dp", "got 0"]),
    "old key sp": (
        ["run", "job.py"],
        {"TESSERA_PARALLEL_SP": "2"},
        ["parallel.sp is now called parallel.cp"],
    ),
    "old key sp_mode": (
        ["run", "--set", "parallel.sp_mode=ulysses", "job.py"],
        {},
        ["parallel.sp_mode is now called parallel.cp_mode"],
    ),
    "env poll wait": (
        ["run", "job.py"],
        {"TESSERA_POLL_WAIT_MS": "fast"},
        ["TESSERA_POLL_WAIT_MS='fast'", "auto"],
    ),
    "env shm": (["run", "job.py"], {"TESSERA_SHM": "maybe"}, ["TESSERA_SHM='maybe'", "off"]),
    "resume missing": (
        ["run", "--set", "train.resume={d}/ckpt", "job.py"],
        {},
        ["train.resume", "ckpt", "not exist"],
    ),
    "resume empty": (
        ["run", "--set", "train.resume={d}/emptydir", "job.py"],
        {},
        ["train.resume", "emptydir"],
    ),
    "resume torn": (["run", "--set", "train.resume={d}/torn", "job.py"], {}, ["train.resume", "torn"]),
    "run_dir file": (
        ["run", "--set", "train.run_dir={d}/empty", "job.py"],
        {},
        ["train.run_dir", "empty", "a file"],
    ),
    "run_dir under file": (
        ["run", "--set", "train.run_dir={d}/empty/runs", "job.py"],
        {},
        ["train.run_dir", "a file"],
    ),
    "corpus missing": (["train", "--set", "data.corpus={d}/nocorpus"], {}, ["data.corpus", "nocorpus"]),
    "corpus tiny": (
        ["train", "--set", "data.corpus={d}/tiny.txt"],
        {},
        ["data.corpus", "tiny.txt", "characters"],
    ),
    "vocab small": (
        ["train", "--set", "model.vocab_size=10"],
        {},
        ["model.vocab_size=10", "distinct characters"],
    ),
    "name reused": (
        ["train", "--set", "train.name=taken", "--set", "train.run_dir={d}/runs"],
        {},
        ["train.name='taken'"],
    ),
}

FILES = {
    "empty": "",
    "badhosts": "node0 slots=x\n",
    "str.toml": '[parallel]\ndp = "2"\n',
    "float.toml": "[train]\nsteps = 2.0\n",
    "bool.toml": "[train]\nsteps = true\n",
    "lr.toml": '[optim]\nlr = "fast"\n',
    "cp.toml": "[parallel]\nsequence_parallel = 1\n",
    "top.toml": "steps = 3\n",
    "broken.toml": "[train\n",
    "tiny.txt": "too short",
    "torn/step-3/model.safetensors": "",
    "job.py": "",
}


def _scratch(d: Path) -> None:
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (d / "emptydir").mkdir()
    (d / "runs" / "taken").mkdir(parents=True)


def _case(name: str, d: Path) -> tuple[list[str], dict[str, str]]:
    argv, env, _ = CASES[name]
    return [a.replace("{d}", str(d)) for a in argv], env


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_there_are_at_least_fifty() -> None:
    assert len(CASES) >= 50


@pytest.mark.parametrize("name", list(CASES))
def test_each_mistake_exits_2_with_one_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _scratch(tmp_path)
    before = _listing(tmp_path)
    argv, env = _case(name, tmp_path)
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("TESSERA_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def spawn(*args: object, **kwargs: object) -> int:
        raise AssertionError("a refused job spawned")

    monkeypatch.setattr(cli, "spawn", spawn)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("tessera: "), err
    for part in CASES[name][2]:
        assert part.replace("{d}", str(tmp_path)) in lines[0], lines[0]
    assert _listing(tmp_path) == before, "a refused job wrote something"


CHILD = """
import contextlib, io, json, os, sys, time, types
from pathlib import Path
import tessera.comm  # the namespace's other packages as usual; tessera.launcher's modules alone:
package = types.ModuleType("tessera.launcher")
package.__path__ = [sys.argv[1]]
sys.modules["tessera.launcher"] = package
from tessera.launcher.run.cli import main
results = []
for argv, env in json.load(sys.stdin):
    os.environ.update(env)
    started = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    results.append((code, time.perf_counter() - started))
    for key in env:
        del os.environ[key]
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


def test_no_refusal_imports_torch(tmp_path: Path) -> None:
    _scratch(tmp_path)
    cases = [_case(name, tmp_path) for name in CASES]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    launcher = str(Path(cli.__file__).parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, launcher],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [code for code, _ in report["results"]] == [2] * len(CASES)
    assert report["torch"] is False, "validation imported torch"
    times = sorted(t for _, t in report["results"])
    print(
        f"{len(times)} refusals in one interpreter: median {times[len(times) // 2] * 1e3:.1f} ms, "
        f"max {times[-1] * 1e3:.1f} ms"
    )


def test_lazy_packages_still_export_every_name() -> None:
    import tessera.comm
    import tessera.pipeline

    for package in (tessera.comm, tessera.pipeline):
        for name in package.__all__:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"


def test_a_lazy_name_is_not_hidden_by_its_submodule(tmp_path: Path) -> None:
    """What a lazy ``tessera.launcher`` needs: ``boost`` the function, in ``boost`` the module."""
    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from tessera.comm import lazy_exports\n"
        "__getattr__, __dir__ = lazy_exports(__name__, ['boost'])\n__all__ = ['boost']\n"
    )
    (package / "boost.py").write_text("def boost():\n    return 'boosted'\n")
    child = "import lazypkg.boost\nfrom lazypkg import boost\nprint(boost())\n"
    out = subprocess.run(
        [sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "boosted", out.stderr
