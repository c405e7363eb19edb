"""``LazyTensors`` reads, through ``tessera.comm.safefile.SafeFile``, exactly what the
safetensors library wrote: every dtype either knows, the metadata, and a name in two files
from the later one."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from tessera.comm.safefile import DTYPES, SafeFile
from tessera.launcher.checkpoint.tensorfile import LazyTensors


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
