"""Checkpoints and the portable state of the chunk memory manager.

Oracle: an uninterrupted run. The chunked optimizer trains bit for bit as the flat one
(test_zero_chunks.py), a checkpoint holds every fp32 value the next steps read (masters,
optimizer state, scalar state, buffers, loss scale, step count) and loading puts them back
unchanged, so a resumed run's losses and weights must equal the uninterrupted run's exactly
(``torch.equal``, no tolerance), whatever tiers and chunk sizes the saving and the loading
optimizer use. The same holds for the portable state: it is the same fp32 values regrouped
by parameter name, so a chunked optimizer's ``full_state()`` equals the flat one's exactly,
and loading it into any stage and world size continues exactly as a flat optimizer of that
configuration loading the same state. Ranks are threads (``run_threaded``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm.consensus import RemoteFailure
from tessera.comm.testing import run_threaded
from tessera.zero import ZeroOptimizer
from tessera.zero.chunks import ChunkConfig, Tier

D, H = 8, 40


class Net(nn.Module):
    """in -> Linear -> Tanh -> Linear -> Tanh -> Linear (about 2k parameters, two optimizer
    groups) with a buffer that every forward changes the same way on every rank."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D, H)
        self.mid = nn.Linear(H, H)
        self.out = nn.Linear(H, D)
        self.register_buffer("calls", torch.zeros(()))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.calls += 1
        y = self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        return y * (1 + 0.01 * self.calls)  # type: ignore[no-any-return]


def batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(4, D, generator=gen), torch.randn(4, D, generator=gen)


def build(case: dict[str, Any], memory: ChunkConfig | None, stage: int | None = None) -> ZeroOptimizer:
    model = Net()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups: Any = [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]
    if case["opt"] == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, eps=1e-6)
    return ZeroOptimizer(
        model,
        opt,
        stage=case["stage"] if stage is None else stage,
        precision=case.get("precision", "fp32"),
        bucket_bytes=case.get("bucket", 2048),
        memory=memory,
    )


def train(zero: ZeroOptimizer, rank: int, steps: range) -> list[Tensor]:
    losses = []
    for step in steps:
        x, y = (t.to(zero.dtype) for t in batch(step, rank))
        loss = F.mse_loss(zero.model(x), y)
        zero.backward(loss)
        assert zero.step() or zero.config.precision == "fp16"  # fp16: an overflow skips a step
        losses.append(loss.detach().float())
    return losses


def finish(zero: ZeroOptimizer) -> dict[str, Tensor]:
    """The fp32 masters by name and the buffer (then the chunk store's scratch is removed)."""
    out = zero.full_parameters()
    out["calls"] = zero.model.calls.detach().float().clone()  # type: ignore[operator]
    if zero._chunks is not None:
        zero._chunks.close()
    return out


def memory_for(mix: str, chunk_numel: int, root: Path) -> ChunkConfig | None:
    """Chunks on the tiers of ``mix`` (``flat``: no chunk manager)."""
    if mix == "flat":
        return None
    if mix == "host":
        return ChunkConfig(chunk_numel=chunk_numel)
    if mix == "disk":  # the host budget holds the staging, the scratch and one chunk
        rounded = -(-chunk_numel // 64) * 64
        return ChunkConfig(host_budget_mb=4 * rounded * 16 / 2**20, disk_dir=root, chunk_numel=chunk_numel)
    if mix == "auto":
        return ChunkConfig(policy="auto", host_budget_mb=256, disk_dir=root, chunk_numel=chunk_numel)
    return ChunkConfig(disk_dir=root, chunk_numel=chunk_numel, fractions=(0.0, 0.5, 0.5))  # host+disk


def same(got: Mapping[str, Tensor], want: Mapping[str, Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = {k: float((got[k] - want[k]).abs().max()) for k in want if not torch.equal(got[k], want[k])}
    assert not bad, bad


# ---------------------------------------------------------------------- save and load
def _resume(rank: int, case: dict[str, Any], tmp: Path) -> dict[str, Any]:
    k, n = case["k"], case["n"]
    straight = build(case, None)
    want = train(straight, rank, range(k + n))
    want_params = finish(straight)

    saving = build(case, memory_for(case["save_mix"], case["save_chunk"], tmp / "a"))
    train(saving, rank, range(k))
    saving.save(tmp / "ckpt")
    after_save = train(saving, rank, range(k, k + n))  # a save changes nothing
    after_params = finish(saving)

    loading = build(case, memory_for(case["load_mix"], case["load_chunk"], tmp / "b"))
    loading.load(tmp / "ckpt")
    assert loading.steps == k
    resumed = train(loading, rank, range(k, k + n))
    assert straight.loss_scale == saving.loss_scale == loading.loss_scale
    return {
        "want": torch.stack(want[k:]),
        "after_save": torch.stack(after_save),
        "resumed": torch.stack(resumed),
        "want_params": want_params,
        "after_params": after_params,
        "resumed_params": finish(loading),
    }


MIXES = ["host", "disk", "host+disk", "auto"]


@settings(
    max_examples=32,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
@given(
    world=st.sampled_from([1, 2]),
    stage=st.sampled_from([0, 1, 2, 3]),
    opt=st.sampled_from(["sgd", "adamw"]),
    save_mix=st.sampled_from(MIXES),
    load_mix=st.sampled_from([*MIXES, "flat"]),
    save_chunk=st.integers(64, 700),
    load_chunk=st.integers(64, 700),
    k=st.integers(0, 2),
    precision=st.sampled_from(["fp32", "fp32", "bf16", "fp16"]),
)
def test_save_load_resumes_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    world: int,
    stage: int,
    opt: str,
    precision: str,
    save_mix: str,
    load_mix: str,
    save_chunk: int,
    load_chunk: int,
    k: int,
) -> None:
    """Train k steps with chunks, save, load into a fresh optimizer (other tiers and chunk
    size, or no chunks), train 2 more: the same losses and weights, bit for bit, as without
    the interruption (k = 0: saved before any optimizer state exists; fp16: the loss scale
    and the steps its overflows skip carry over too)."""
    case = dict(
        world=world,
        stage=stage,
        opt=opt,
        save_mix=save_mix,
        load_mix=load_mix,
        save_chunk=save_chunk,
        load_chunk=load_chunk,
        k=k,
        n=2,
        precision=precision,
    )
    for res in run_threaded(world, _resume, case, tmp_path_factory.mktemp("ckpt")):
        assert torch.equal(res["after_save"], res["want"]), (res["after_save"], res["want"])
        assert torch.equal(res["resumed"], res["want"]), (res["resumed"], res["want"])
        same(res["after_params"], res["want_params"])
        same(res["resumed_params"], res["want_params"])


def _save_both(rank: int, case: dict[str, Any], tmp: Path) -> None:
    for mix in ("flat", "disk"):
        zero = build(case, memory_for(mix, 128, tmp / f"scratch-{mix}"))
        train(zero, rank, range(2))
        zero.save(tmp / mix)
        finish(zero)


@pytest.mark.parametrize(
    ("stage", "opt", "precision"),
    [(0, "adamw", "fp32"), (1, "sgd", "fp32"), (3, "adamw", "fp32"), (3, "adamw", "bf16")],
)
def test_chunked_checkpoint_is_the_flat_format(tmp_path: Path, stage: int, opt: str, precision: str) -> None:
    """With and without chunks the rank files hold the same tensors, by the same names, and
    ``meta.json`` the same fields: a plain safetensors file that ``safetensors`` reads."""
    case = {"world": 2, "stage": stage, "opt": opt, "precision": precision}
    run_threaded(2, _save_both, case, tmp_path)
    flat_meta = json.loads((tmp_path / "flat" / "meta.json").read_text())
    chunk_meta = json.loads((tmp_path / "disk" / "meta.json").read_text())
    for key in ("format", "world_size", "stage", "replicated", "optimizer", "steps", "layout", "files"):
        assert chunk_meta[key] == flat_meta[key], key
    for name in flat_meta["files"]:
        want = safetensors.torch.load((tmp_path / "flat" / name).read_bytes())
        got = safetensors.torch.load((tmp_path / "disk" / name).read_bytes())
        same(got, want)
        with open(tmp_path / "disk" / name, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        with open(tmp_path / "flat" / name, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            flat_header = json.loads(f.read(size))
        assert json.loads(header["__metadata__"]["tessera-zero"]) == json.loads(
            flat_header["__metadata__"]["tessera-zero"]
        )


# ---------------------------------------------------------------------- refusals
def _load_or_error(rank: int, case: dict[str, Any], path: Path, scratch: Path) -> str:
    zero = build(case, memory_for("disk", 128, scratch))
    try:
        zero.load(path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        finish(zero)
    return "loaded"


def _save_chunked(rank: int, case: dict[str, Any], path: Path, scratch: Path) -> None:
    zero = build(case, memory_for("disk", 128, scratch))
    train(zero, rank, range(2))
    zero.save(path)
    finish(zero)


@pytest.mark.parametrize("how", ["flipped", "missing", "truncated"])
@pytest.mark.parametrize("load_mix", ["disk", "flat"])
def test_a_bad_rank_file_is_refused_on_every_rank(tmp_path: Path, how: str, load_mix: str) -> None:
    case = {"world": 2, "stage": 3, "opt": "adamw"}
    run_threaded(2, _save_chunked, case, tmp_path / "ckpt", tmp_path / "s")
    victim = tmp_path / "ckpt" / "rank-00001-of-00002.safetensors"
    if how == "missing":
        victim.unlink()
    elif how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-4])
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))

    def load(rank: int) -> str:
        if load_mix == "flat":
            zero = build(case, None)
            try:
                zero.load(tmp_path / "ckpt")
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            return "loaded"
        return _load_or_error(rank, case, tmp_path / "ckpt", tmp_path / "s2")

    first, second = run_threaded(2, load)
    assert first.startswith(RemoteFailure.__name__) and "rank 1" in first, first
    assert str(victim) in second, second
    assert ("missing" if how == "missing" else "checksum mismatch") in second or (
        how == "missing" and "No such file" in second
    ), second


def test_world_size_and_stage_must_match(tmp_path: Path) -> None:
    case = {"world": 2, "stage": 2, "opt": "sgd"}
    run_threaded(2, _save_chunked, case, tmp_path / "ckpt", tmp_path / "s")
    (message,) = run_threaded(1, _load_or_error, case, tmp_path / "ckpt", tmp_path / "s1")
    assert "saved by 2 ranks but this group has 1" in message, message
    other = {**case, "stage": 3}
    messages = run_threaded(2, _load_or_error, other, tmp_path / "ckpt", tmp_path / "s3")
    assert all("is ZeRO stage 2, this optimizer is 3" in m for m in messages), messages


def _save_over_corrupt_disk(rank: int, case: dict[str, Any], path: Path, scratch: Path) -> str:
    zero = build(case, memory_for("disk", 128, scratch))
    train(zero, rank, range(3))
    store = zero._chunks
    assert store is not None and store.disk is not None
    if rank == 1:
        chunk = next(c for c in store.chunks if c.tier is Tier.DISK)
        victim = store.disk.path(chunk.index, "exp_avg")
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0x10
        victim.write_bytes(bytes(data))
    try:
        zero.save(path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        finish(zero)
    return "saved"


def test_a_failed_save_is_refused_on_every_rank_and_never_loaded(tmp_path: Path) -> None:
    """A disk-tier file altered under the store makes the next save fail on every rank (the
    CRC-32 check of the read): the failing rank's previous file stays as it was, no temporary
    file is left, and the torn directory (rank 0's new file under the old ``meta.json``) is
    refused by its checksum rather than loaded half old, half new."""
    case = {"world": 2, "stage": 1, "opt": "adamw"}
    victim = tmp_path / "ckpt" / "rank-00001-of-00002.safetensors"
    run_threaded(2, _save_chunked, case, tmp_path / "ckpt", tmp_path / "s0")
    before = victim.read_bytes()
    first, second = run_threaded(2, _save_over_corrupt_disk, case, tmp_path / "ckpt", tmp_path / "s")
    assert first.startswith("RemoteFailure") and "rank 1" in first, first
    assert second.startswith("ChunkFileError") and "does not hold what was written" in second, second
    assert victim.read_bytes() == before
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    first, second = run_threaded(2, _load_or_error, case, tmp_path / "ckpt", tmp_path / "s2")
    assert "rank-00000-of-00002.safetensors: checksum mismatch" in first, first
    assert second.startswith("RemoteFailure"), second


# ---------------------------------------------------------------------- portable state
class Lazy(Mapping[str, Tensor]):
    """A mapping that counts reads and refuses to hand out its values in bulk."""

    def __init__(self, data: Mapping[str, Tensor]) -> None:
        self.data = dict(data)
        self.reads: dict[str, int] = {}

    def __getitem__(self, key: str) -> Tensor:
        self.reads[key] = self.reads.get(key, 0) + 1
        return self.data[key]

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def items(self) -> Any:
        raise AssertionError("the whole state was read at once")

    def values(self) -> Any:
        raise AssertionError("the whole state was read at once")


def _state_of(rank: int, case: dict[str, Any], mix: str, tmp: Path, steps: int) -> dict[str, Any]:
    zero = build(case, memory_for(mix, 96, tmp))
    layout_before = zero.full_state_layout()
    train(zero, rank, range(steps))
    layout = zero.full_state_layout()
    pairs = list(zero.iter_full_state())
    state = dict(pairs)
    assert zero.full_state().keys() == state.keys()
    finish(zero)
    return {
        "layout_before": layout_before,
        "layout": layout,
        "yielded": [(k, tuple(v.shape), v.dtype, v.device.type) for k, v in pairs],
        "state": state,
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_chunked_full_state_equals_flat_and_its_layout(tmp_path: Path, stage: int, opt: str) -> None:
    case = {"world": 2, "stage": stage, "opt": opt}
    flat = run_threaded(2, _state_of, case, "flat", tmp_path / "f", 2)
    chunked = run_threaded(2, _state_of, case, "host+disk", tmp_path / "c", 2)
    for f, c in zip(flat, chunked, strict=True):
        same(c["state"], f["state"])
        for res in (f, c):
            assert [(k, s) for k, s, _, _ in res["yielded"]] == res["layout"]
            assert {(dtype, device) for _, _, dtype, device in res["yielded"]} == {(torch.float32, "cpu")}
            assert all(k.startswith("param/") for k, _ in res["layout_before"])  # no state before a step
            assert len(res["layout_before"]) == len(list(Net().parameters()))
        assert sorted(c["layout"]) == sorted(f["layout"])
    kinds = {k.split("/")[0] for k in flat[0]["state"]}
    assert kinds == (
        {"param", "optim.momentum_buffer"}
        if opt == "sgd"
        else {"param", "optim.exp_avg", "optim.exp_avg_sq", "optim.step"}
    )


def _continue(
    rank: int, case: dict[str, Any], mix: str, tmp: Path, state: dict[str, Tensor]
) -> dict[str, Any]:
    zero = build(case, memory_for(mix, 80, tmp))
    train(zero, rank, range(1))  # state of its own first, which loading must replace
    lazy = Lazy(state)
    zero.load_full_state(lazy, steps=2)
    once = all(n <= 1 for k, n in lazy.reads.items() if "/group" not in k)
    same(zero.full_state(), state)  # what was loaded is what it holds now, exactly
    losses = train(zero, rank, range(2, 4))
    return {"losses": torch.stack(losses), "params": finish(zero), "state_read_once": once}


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ((2, 3, "flat"), (1, 1, "disk")),
        ((1, 2, "flat"), (2, 3, "host+disk")),
        ((2, 0, "disk"), (2, 2, "flat")),
        ((2, 3, "host+disk"), (1, 0, "flat")),
        ((1, 3, "disk"), (2, 1, "auto")),
    ],
    ids=str,
)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_portable_state_moves_between_chunks_flat_worlds_and_stages(
    tmp_path: Path, source: tuple[int, int, str], target: tuple[int, int, str], opt: str
) -> None:
    """Train 2 steps under ``source`` (world, stage, mix), take its portable state, load it
    into ``target`` and train 2 more: exactly as a flat optimizer of ``target`` loading the
    same state; the loading reads each parameter's tensor once per rank."""
    move(tmp_path, source, target, opt)


@settings(
    max_examples=16,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
@given(
    source=st.tuples(
        st.sampled_from([1, 2]), st.sampled_from([0, 1, 2, 3]), st.sampled_from(["flat", *MIXES])
    ),
    target=st.tuples(st.sampled_from([1, 2]), st.sampled_from([0, 1, 2, 3]), st.sampled_from(MIXES)),
    opt=st.sampled_from(["sgd", "adamw"]),
)
def test_portable_state_moves_anywhere(
    tmp_path_factory: pytest.TempPathFactory,
    source: tuple[int, int, str],
    target: tuple[int, int, str],
    opt: str,
) -> None:
    """The same, over drawn worlds, stages and tier mixes."""
    move(tmp_path_factory.mktemp("portable"), source, target, opt)


def move(tmp: Path, source: tuple[int, int, str], target: tuple[int, int, str], opt: str) -> None:
    (sw, ss, smix), (tw, ts, tmix) = source, target
    (state, *_) = [
        r["state"]
        for r in run_threaded(sw, _state_of, {"world": sw, "stage": ss, "opt": opt}, smix, tmp / "s", 2)
    ]
    tcase = {"world": tw, "stage": ts, "opt": opt}
    want = run_threaded(tw, _continue, tcase, "flat", tmp / "w", state)
    got = run_threaded(tw, _continue, tcase, tmix, tmp / "g", state)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["losses"], w["losses"]), (g["losses"], w["losses"])
        same(g["params"], w["params"])
        assert g["state_read_once"] and w["state_read_once"]


def test_loading_state_saved_before_the_first_step_leaves_the_optimizer_fresh(tmp_path: Path) -> None:
    case = {"world": 2, "stage": 3, "opt": "adamw"}
    (state, _) = [r["state"] for r in run_threaded(2, _state_of, case, "disk", tmp_path / "s", 0)]
    assert all(k.startswith("param/") for k in state)
    want = run_threaded(2, _continue, case, "flat", tmp_path / "w", state)
    got = run_threaded(2, _continue, case, "disk", tmp_path / "g", state)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["losses"], w["losses"])
        same(g["params"], w["params"])
