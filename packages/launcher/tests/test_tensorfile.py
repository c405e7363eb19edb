"""``LazyTensors`` reads, through ``tessera.comm.safefile.SafeFile``, exactly what the
safetensors library wrote: every dtype either knows, the metadata, and a name in two files
from the later one."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from tessera.comm.safefile import DTYPES, SafeFile
from tessera.launcher.checkpoint.exported import Band
from tessera.launcher.checkpoint.tensorfile import LazyTensors, Renamed


def test_lazy_tensors_read_what_safetensors_wrote(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    want = {
        f"t.{str(dtype).removeprefix('torch.')}": (torch.randn(3, 4, generator=g) * 10).to(dtype)
        for dtype in DTYPES
    }
    want["scalar"] = torch.tensor(2.5)
    want["empty"] = torch.zeros(0, 3)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors.torch.save_file(want, str(first), metadata={"k": "v"})
    safetensors.torch.save_file({"scalar": torch.tensor(7.0)}, str(second))
    with LazyTensors([first, second]) as lazy:
        assert lazy.metadata(0) == {"k": "v"}
        assert lazy.metadata(1) == {}
        assert set(lazy) == set(want)
        for name, tensor in want.items():
            got = lazy[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            expected = torch.tensor(7.0) if name == "scalar" else tensor
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
    data = first.read_bytes()
    assert SafeFile(first, data).entries == SafeFile(first).entries
    assert SafeFile(first, data).metadata == {"k": "v"}
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafeFile(first, data[:20])


@pytest.mark.parametrize(
    ("shape", "dim", "start", "stop", "step", "first"),
    [
        ((3, 4, 2048), -1, 0, 1024, 1, (0, 3)),  # a gate band by columns, rows of 4 KiB: one run per row
        ((3, 4, 2048), -1, 1024, 2048, 1, (1, 3)),  # the up band of some experts
        ((3, 4, 64), -1, 16, 48, 1, (0, 2)),  # runs under MIN_RUN_BYTES: read whole, then cut
        ((3, 4, 2048), -1, 1, 2048, 2, (0, 3)),  # strided: read whole, then cut
        ((2, 2048), -1, 1024, 2048, 1, (0, 2)),  # a 2-D tensor
        ((3, 6, 8), -2, 2, 5, 1, (1, 3)),  # rows: one run per row block
    ],
)
def test_read_part_cuts_what_slicing_cuts(
    tmp_path: Path, shape: tuple[int, ...], dim: int, start: int, stop: int, step: int, first: tuple[int, int]
) -> None:
    """Every way ``read_part`` reads a band (runs per row, per row block, or the slice whole
    then cut) gives exactly the tensor's slice (``torch.equal``: bytes copied, no arithmetic)."""
    whole = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    safetensors.torch.save_file({"bank": whole}, tmp_path / "f.safetensors")
    part = whole[first[0] : first[1]]
    want = part[..., start:stop:step] if dim == -1 else part[..., start:stop:step, :]
    with LazyTensors([tmp_path / "f.safetensors"]) as lazy:
        got = lazy.read_part("bank", first, Band(dim, start, stop, step))
    assert torch.equal(got, want), f"{shape} {dim} {start}:{stop}:{step} of {first}"


@pytest.mark.parametrize("first", [None, (0, 6)])
def test_a_matrix_row_band_is_read_as_its_rows(tmp_path: Path, first: tuple[int, int] | None) -> None:
    """Rows ``2:5`` of a matrix (DBRX's flat ``mlp.w1 [E*h, d]``, one expert's rows): a row band
    of a 2-D tensor is its first dimension's slice (``torch.equal``: bytes copied)."""
    whole = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    safetensors.torch.save_file({"flat": whole}, tmp_path / "f.safetensors")
    with LazyTensors([tmp_path / "f.safetensors"]) as lazy:
        assert torch.equal(lazy.read_part("flat", first, Band(-2, 2, 5)), whole[2:5])
        with pytest.raises(ValueError, match=r"flat \[6, 8\] has no part"):
            lazy.read_part("flat", first, Band(-2, 4, 7))


def test_renamed_tensors_are_read_under_their_new_names(tmp_path: Path) -> None:
    """``rename``: each stored tensor known by the name it gives (a family's loading renames),
    read from its file under its own, and held transposed where it says so; two stored tensors
    given one name are refused."""
    a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0).view(2, 2)
    safetensors.torch.save_file({"old.a": a, "b": b}, tmp_path / "f.safetensors")
    renamed = lambda n: Renamed(n.replace("old.", "new."), transposed=n == "old.a")  # noqa: E731
    with LazyTensors([tmp_path / "f.safetensors"], rename=renamed) as lazy:
        assert sorted(lazy) == ["b", "new.a"] and "old.a" not in lazy
        assert lazy.transposed("new.a") and not lazy.transposed("b")
        assert (
            torch.equal(lazy["new.a"], a)
            and lazy.shape("new.a") == (2, 3)
            and lazy.stored("new.a") == "old.a"
        )
        assert torch.equal(lazy.read_part("new.a", (1, 2)), a[1:2]) and lazy.dtype("new.a") == torch.float32
    with pytest.raises(ValueError, match=r"b and old\.a both read as b"):
        LazyTensors([tmp_path / "f.safetensors"], rename=lambda n: Renamed("b"))


def test_a_vector_band_is_read(tmp_path: Path) -> None:
    """A bias split on load (a fused ``query_key_value.bias``): its band of indices ``2:5``."""
    whole = torch.randn(8, generator=torch.Generator().manual_seed(0))
    safetensors.torch.save_file({"bias": whole}, tmp_path / "f.safetensors")
    with LazyTensors([tmp_path / "f.safetensors"]) as lazy:
        assert torch.equal(lazy.read_part("bias", None, Band(-1, 2, 5)), whole[2:5])
        with pytest.raises(ValueError, match=r"bias \[8\] has no part"):
            lazy.read_part("bias", None, Band(-1, 6, 9))
