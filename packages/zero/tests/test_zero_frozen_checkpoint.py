"""Checkpoints of frozen parameters, which keep only their compute-dtype values.

Oracle: an uninterrupted run. A frozen parameter's saved value is the compute-dtype value
the model computes with (``master.<i>`` in bf16 under bf16), so a save and a load, flat or
chunked, offloaded or not, in any combination, resume bit for bit (``torch.equal`` on losses
and weights). A checkpoint written before frozen FlatParams dropped their fp32 masters held
the model's original fp32 values there: it must load, rounded to bf16 as building the
optimizer rounds them, and so also resume bit for bit; one whose masters have a dtype the
optimizer cannot take is refused naming the tensor. Ranks are threads (``run_threaded``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm.consensus import RemoteFailure
from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.precision import compute_dtype


def _sibling(name: str) -> ModuleType:  # (tests import with --import-mode=importlib: no packages)
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_frozen = _sibling("test_zero_frozen")  # the model, batches, optimizer and tiers of the training tests
BACKBONE, Net, batch, memory_for, sgd = (
    _frozen.BACKBONE,
    _frozen.Net,
    _frozen.batch,
    _frozen.memory_for,
    _frozen.sgd,
)
Case = dict[str, Any]


def build(case: Case, mode: str, root: Path, *, shift: float = 0.0) -> ZeroOptimizer:
    """``Net`` with the backbone frozen (and, by ``shift``, given other values: a load must
    restore them) under ZeRO in ``mode`` (flat, offload, or chunks on the host and disk)."""
    model = Net(BACKBONE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.0 if p.requires_grad else shift)
    return ZeroOptimizer(
        model,
        sgd([p for p in model.parameters() if p.requires_grad]),
        stage=case["stage"],
        precision=case["precision"],
        offload=mode == "offload",
        bucket_bytes=case.get("bucket", 4096),
        memory=memory_for(mode, root),
    )


def train(zero: ZeroOptimizer, rank: int, steps: range) -> list[Tensor]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, zero.dtype)
        loss = F.mse_loss(zero.model(x), y)
        zero.backward(loss)
        assert zero.step()
        losses.append(loss.detach().float())
    return losses


def finish(zero: ZeroOptimizer) -> dict[str, Tensor]:
    out = zero.full_parameters()
    zero.close()
    return out


def _resume(rank: int, case: Case, tmp: Path) -> dict[str, Any]:
    k, n = case["k"], 2
    straight = build(case, "flat", tmp / f"u{rank}")
    want = train(straight, rank, range(k + n))
    saving = build(case, case["save"], tmp / f"s{rank}")
    train(saving, rank, range(k))
    saving.save(tmp / "ckpt")
    finish(saving)
    if case.get("old"):  # as written before frozen masters were dropped (module docstring)
        if rank == 0:
            _write_as_before(tmp / "ckpt")
        torch.distributed.barrier()
    loading = build(case, case["load"], tmp / f"l{rank}", shift=1.0)
    loading.load(tmp / "ckpt")
    resumed = train(loading, rank, range(k, k + n))
    return {
        "want": torch.stack(want[k:]),
        "resumed": torch.stack(resumed),
        "want_params": finish(straight),
        "params": finish(loading),
    }


def _write_as_before(path: Path) -> None:
    """Rewrite the checkpoint at ``path`` as the optimizer wrote it when frozen FlatParams kept
    an fp32 master: each frozen ``master.<i>`` holds that rank's shard of the model's original
    fp32 values (not rounded to the compute dtype), and ``meta.json`` their new checksums."""
    meta = json.loads((path / "meta.json").read_text())
    original = dict(Net().named_parameters())
    ways = len(meta["files"])  # stage 0 writes one file for every rank
    for index, name in enumerate(meta["files"]):
        file = path / name
        with safetensors.safe_open(str(file), "pt") as f:
            metadata = f.metadata()
        tensors = safetensors.torch.load(file.read_bytes())
        for i, flat in enumerate(meta["layout"]):
            if flat["group"] != 1:  # the optimizer has one group: 1 is the frozen pseudo-group
                continue
            source = torch.zeros(flat["padded_numel"])
            start = 0
            for pname in flat["names"]:
                value = original[pname].detach().reshape(-1)
                source[start : start + value.numel()] = value
                start += value.numel()
            shard = flat["padded_numel"] // ways
            assert tensors[f"master.{i}"].dtype == torch.bfloat16
            tensors[f"master.{i}"] = source[index * shard : (index + 1) * shard].clone()
        data = safetensors.torch.save(tensors, metadata=metadata)
        file.write_bytes(data)
        meta["sha256"][index] = hashlib.sha256(data).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))


MODES = ["flat", "offload", "chunks"]


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
@given(
    world=st.sampled_from([1, 2]),
    stage=st.sampled_from([0, 1, 2, 3]),
    precision=st.sampled_from(["bf16", "bf16", "fp32"]),
    save=st.sampled_from(MODES),
    load=st.sampled_from(MODES),
    k=st.integers(0, 2),
)
def test_a_save_and_load_with_frozen_parameters_resumes_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    world: int,
    stage: int,
    precision: str,
    save: str,
    load: str,
    k: int,
) -> None:
    """Train k steps, save, load into an optimizer whose frozen parameters were built with
    other values (flat, offloaded or chunked, whatever saved it), train 2 more: the losses
    and every weight equal the uninterrupted run's, the frozen ones their compute-dtype
    values."""
    case = {"world": world, "stage": stage, "precision": precision, "save": save, "load": load, "k": k}
    dtype = compute_dtype(precision)
    start = dict(Net().named_parameters())
    for res in run_threaded(world, _resume, case, tmp_path_factory.mktemp("ckpt")):
        assert torch.equal(res["resumed"], res["want"]), (res["resumed"], res["want"])
        bad = [n for n in res["want_params"] if not torch.equal(res["params"][n], res["want_params"][n])]
        assert not bad, bad
        for name in (n for n in start if n.rsplit(".", 1)[0] in BACKBONE):
            assert torch.equal(res["params"][name], start[name].detach().to(dtype).float()), name


@pytest.mark.parametrize("load", ["flat", "chunks"])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_checkpoint_with_fp32_frozen_masters_still_loads(tmp_path: Path, stage: int, load: str) -> None:
    """A bf16 checkpoint as written before this change (frozen masters in fp32, the original
    values) loads flat and chunked, and the run resumes exactly as if it held bf16 ones."""
    case = {
        "world": 2,
        "stage": stage,
        "precision": "bf16",
        "save": "flat",
        "load": load,
        "k": 1,
        "old": True,
    }
    for res in run_threaded(2, _resume, case, tmp_path):
        assert torch.equal(res["resumed"], res["want"]), (res["resumed"], res["want"])
        bad = [n for n in res["want_params"] if not torch.equal(res["params"][n], res["want_params"][n])]
        assert not bad, bad


def _save(rank: int, case: Case, tmp: Path) -> None:
    zero = build(case, "flat", tmp / f"s{rank}")
    train(zero, rank, range(1))
    zero.save(tmp / "ckpt")
    finish(zero)


def _load_error(rank: int, case: Case, mode: str, tmp: Path) -> str:
    zero = build(case, mode, tmp / f"l{rank}")
    try:
        zero.load(tmp / "ckpt")
    except (ValueError, RemoteFailure) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        finish(zero)
    return "loaded"


def _retype(path: Path, group: int, dtype: torch.dtype) -> list[int]:
    """Store every master of optimizer group ``group`` (1: frozen) of the checkpoint in
    ``dtype`` and fix the checksums; the indices of the masters changed."""
    meta = json.loads((path / "meta.json").read_text())
    changed = [i for i, flat in enumerate(meta["layout"]) if flat["group"] == group]
    for index, name in enumerate(meta["files"]):
        file = path / name
        with safetensors.safe_open(str(file), "pt") as f:
            metadata = f.metadata()
        tensors = safetensors.torch.load(file.read_bytes())
        for i in changed:
            tensors[f"master.{i}"] = tensors[f"master.{i}"].to(dtype)
        data = safetensors.torch.save(tensors, metadata=metadata)
        file.write_bytes(data)
        meta["sha256"][index] = hashlib.sha256(data).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))
    return changed


@pytest.mark.parametrize("mode", ["flat", "chunks"])
@pytest.mark.parametrize(("group", "dtype"), [(1, torch.float16), (0, torch.bfloat16)])
def test_a_master_of_another_dtype_is_refused_naming_it(
    tmp_path: Path, mode: str, group: int, dtype: torch.dtype
) -> None:
    """A frozen master in fp16 where the optimizer computes in bf16, or a trained master that
    is not fp32, is refused before the ranks agree, naming the file, the tensor and the
    dtypes it may have."""
    case = {"world": 2, "stage": 1, "precision": "bf16"}
    run_threaded(2, _save, case, tmp_path)
    changed = _retype(tmp_path / "ckpt", group, dtype)
    want = "torch.bfloat16 or torch.float32" if group == 1 else "expected torch.float32"
    for message in run_threaded(2, _load_error, case, mode, tmp_path):
        assert message.startswith("ValueError: "), message
        assert f"master.{changed[0]} (" in message and f"is {dtype}" in message and want in message, message
