"""Tier 2: sharded checkpoints resume bit for bit, and refuse what they cannot load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.models import GPT, GPTConfig, make_batch
from tessera.zero import ZeroOptimizer

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)


def _build(case: dict[str, Any], *, shift_frozen: float = 0.0) -> tuple[GPT, ZeroOptimizer]:
    model = GPT(CFG, seed=1)
    if case.get("frozen"):  # the embeddings and the first block's attention (its norm trains)
        model.embed.requires_grad_(False)
        model.layers[0].attn.requires_grad_(False)  # type: ignore[union-attr]
        with torch.no_grad():  # a model built otherwise: the checkpoint must restore them
            for p in model.parameters():
                p.add_(0.0 if p.requires_grad else shift_frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = ZeroOptimizer(
        model,
        opt,
        stage=case["stage"],
        precision=case["precision"],
        offload=case["offload"],
        clip_grad_norm=1.0,
        bucket_bytes=2048,
    )
    return model, zero


def _run(rank: int, model: GPT, zero: ZeroOptimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model.loss(*make_batch(CFG, 2, seed=10 * step + rank))
        zero.backward(loss)
        zero.step()
        losses.append(loss.item())
    return losses


def _resume(rank: int, case: dict[str, Any], path: str) -> tuple[list[float], list[float], float, float]:
    model, zero = _build(case)
    _run(rank, model, zero, range(3))
    zero.save(path)
    straight = _run(rank, model, zero, range(3, 6))
    model2, zero2 = _build(case, shift_frozen=1.0)
    zero2.load(path)
    resumed = _run(rank, model2, zero2, range(3, 6))
    return straight, resumed, zero.loss_scale, zero2.loss_scale


@pytest.mark.parametrize(
    "case",
    [
        {"stage": 0, "precision": "fp32", "offload": False},
        {"stage": 0, "precision": "bf16", "offload": False},
        {"stage": 1, "precision": "fp32", "offload": True},
        {"stage": 2, "precision": "fp16", "offload": False},
        {"stage": 3, "precision": "bf16", "offload": False},
        {"stage": 0, "precision": "fp32", "offload": False, "frozen": True},
        {"stage": 1, "precision": "bf16", "offload": True, "frozen": True},
        {"stage": 3, "precision": "fp32", "offload": False, "frozen": True},
    ],
    ids=lambda c: (
        f"stage{c['stage']}-{c['precision']}{'-offload' if c['offload'] else ''}"
        f"{'-frozen' if c.get('frozen') else ''}"
    ),
)
def test_save_and_load_resume_exactly(worker_pools: Any, tmp_path: Path, case: dict[str, Any]) -> None:
    results = worker_pools(2).run(_resume, case, str(tmp_path / "ckpt"))
    for straight, resumed, scale, scale2 in results:
        assert straight == resumed and scale == scale2
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["stage"] == case["stage"]
    if case["stage"] == 0:  # replicated state: written once
        assert files == ["meta.json", "rank-00000-of-00001.safetensors"]
        assert meta["replicated"] and len(meta["sha256"]) == 1
    else:
        assert files == ["meta.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
        assert not meta["replicated"] and len(meta["sha256"]) == 2


def _portable_across_load(rank: int, case: dict[str, Any], path: str) -> list[str]:
    model, zero = _build(case)
    _run(rank, model, zero, range(2))
    before = zero.full_state()
    zero.save(path)
    _, zero2 = _build(case, shift_frozen=1.0)
    zero2.load(path)
    after = zero2.full_state()
    assert list(before) == list(after), (list(before), list(after))
    return [key for key in before if not torch.equal(before[key], after[key])]


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_state_after_a_load_equals_before_the_save(
    worker_pools: Any, tmp_path: Path, stage: int, frozen: bool
) -> None:
    """The portable state (what reshard saves and consolidation read) of a loaded optimizer is
    the one that was saved, bit for bit: each kind of state is gathered by one collective per
    flat buffer, so every rank must take the kinds in the same order; a load fills each rank's
    optimizer state dict in another order than training did (this failed: Adam's moments of
    the two ranks' halves were gathered crosswise)."""
    case = {"stage": stage, "precision": "fp32", "offload": False, "frozen": frozen}
    differing = worker_pools(2).run(_portable_across_load, case, str(tmp_path / "ckpt"))
    assert differing == [[], []], differing


def _save(rank: int, case: dict[str, Any], path: str) -> None:
    model, zero = _build(case)
    _run(rank, model, zero, range(1))
    zero.save(path)


def _load_error(rank: int, case: dict[str, Any], path: str | list[str]) -> str:
    _, zero = _build(case)
    try:
        zero.load(path if isinstance(path, str) else path[rank])
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


AGREED = "RemoteFailure: checking the checkpoint failed on 1 rank(s) (this is rank 0); rank 1: "


def test_load_refuses_what_it_cannot_load(worker_pools: Any, tmp_path: Path) -> None:
    case = {"stage": 2, "precision": "fp32", "offload": False}
    path = str(tmp_path / "ckpt")
    worker_pools(2).run(_save, case, path)
    four = worker_pools(4).run(_load_error, case, path)
    assert all("saved by 2 ranks but this group has 4" in msg for msg in four), four
    other_stage = worker_pools(2).run(_load_error, case | {"stage": 3}, path)
    assert all("is ZeRO stage 2, this optimizer is 3" in msg for msg in other_stage), other_stage
    missing = worker_pools(2).run(_load_error, case, str(tmp_path / "nothing"))
    assert all("meta.json is missing" in msg for msg in missing)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_bad_file_makes_every_rank_raise(worker_pools: Any, tmp_path: Path, stage: int) -> None:
    """Every rank checks its files before the first collective of ``load`` (the agreement),
    so one rank's corrupt shard, or one rank seeing another checkpoint, raises everywhere
    instead of leaving the other ranks waiting in a collective."""
    case = {"stage": stage, "precision": "fp32", "offload": False}
    good, foreign = tmp_path / "good", tmp_path / "foreign"
    worker_pools(2).run(_save, case, str(good))
    worker_pools(2).run(_save, case | {"stage": (stage + 1) % 4}, str(foreign))
    mixed = worker_pools(2).run(_load_error, case, [str(good), str(foreign)])
    assert mixed[0].startswith(AGREED) and "this optimizer is" in mixed[1], mixed
    assert mixed[1].split(": ", 1)[1] in mixed[0], mixed  # the other rank quotes the cause
    victim = 0 if stage == 0 else 1  # stage 0: the one file every rank reads
    shard = good / f"rank-0000{victim}-of-0000{1 if stage == 0 else 2}.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    tampered = worker_pools(2).run(_load_error, case, str(good))
    if stage == 0:
        assert all(m.startswith("ValueError:") and "checksum mismatch" in m for m in tampered), tampered
    else:
        assert tampered[0].startswith(AGREED) and "checksum mismatch" in tampered[0], tampered
        assert tampered[1].startswith("ValueError:") and "checksum mismatch" in tampered[1]
