"""Tier 0: ``benchmarks/peers-all.py`` pairs each benchmark's records with their peers and
writes the ratios it should, on records shaped as the benchmarks print them (no benchmark is
run here; ``hatch run bench peers-all`` runs them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("peers_all", ROOT / "benchmarks" / "peers-all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PA = _load()


def _rec(system: str, config: str, step: float | None) -> dict[str, Any]:
    return {"system": system, "config": config, "step_time_s": step}


def _pairs(part: str, records: list[dict[str, Any]]) -> dict[tuple[str, str], float | None]:
    return {(p.mode, p.peer): p.ratio for p in PA.PARTS[part].pairs(records)}


def test_tp_pairs_each_plan_with_dtensor_and_leaves_the_rest() -> None:
    blocks, full = "tp=2 plan=blocks gpt d=64", "tp=2 plan=full gpt d=64"
    records = [
        _rec("tessera", blocks, 0.1), _rec("torch-dtensor", blocks, 0.25),
        _rec("tessera", full, 0.2), _rec("torch-dtensor", full, 0.3),
        _rec("tessera", "tp=2 plan=full+sp gpt d=64", 0.2), _rec("torch-ddp", "dp=2 plan=dp gpt", 0.1),
    ]  # fmt: skip
    assert _pairs("tp", records) == {("tp=2 blocks", "DTensor"): 2.5, ("tp=2 full", "DTensor"): 1.5}


def test_zero_pairs_every_stage_with_each_of_its_peers() -> None:
    records = [
        _rec("tessera", "stage=1 gpt", 0.1), _rec("torch-ddp", "stage=1 gpt", 0.12),
        _rec("torch-single", "stage=none gpt", 0.05), _rec("deepspeed-zero", "stage=1 gpt", 0.3),
        _rec("tessera", "stage=3 gpt", 0.2), _rec("torch-fsdp2", "stage=3 gpt", 0.5),
        _rec("deepspeed-zero", "stage=3 gpt", None),  # DeepSpeed did not run: no ratio
    ]  # fmt: skip
    assert _pairs("zero", records) == {
        ("ZeRO-1", "torch DDP"): 1.2, ("ZeRO-1", "DeepSpeed ZeRO"): 3.0,
        ("ZeRO-3", "FSDP2"): 2.5, ("ZeRO-3", "DeepSpeed ZeRO"): None,
    }  # fmt: skip


def test_pipeline_pairs_torch_schedules_and_tesseras_own_1f1b() -> None:
    torch_pair = "gpt L4 p=2 v=1 m=8: tessera zb-h1 vs torch Schedule1F1B"
    own = "gpt L4 p=2 v=1 m=8: tessera zb-h1+tune vs tessera:1f1b"
    itself = "gpt L4 p=2 v=1 m=8: tessera 1f1b vs tessera:1f1b"
    records = [
        _rec("torch-single", "gpt L4 one process", 0.5),
        _rec("tessera", torch_pair, 0.2), _rec("torch-pipelining", torch_pair, 0.22),
        _rec("tessera", own, 0.25), _rec("tessera-1f1b", own, 0.2),
        _rec("tessera", itself, 0.2), _rec("tessera-1f1b", itself, 0.2),
    ]  # fmt: skip
    pairs = list(PA.PARTS["pipeline"].pairs(records))
    assert {(p.mode, p.peer): p.ratio for p in pairs} == {
        ("pp=2 zb-h1", "torch Schedule1F1B"): 1.1,
        ("pp=2 zb-h1+tune", "Tessera 1F1B"): 0.8,
        ("pp=2 1f1b (itself)", "Tessera 1F1B"): 1.0,
    }
    assert [p.goal for p in pairs] == [1.3, 1.0, None]


def test_the_table_gives_each_round_the_median_and_whether_the_goal_is_met() -> None:
    rows = {
        ("tp=2 full", "DTensor"): [1.2, 1.5, 1.4],
        ("ZeRO-3", "DeepSpeed ZeRO"): [None, None, None],
        ("pp=2 1f1b (itself)", "Tessera 1F1B"): [0.99, 1.0, 1.01],
    }
    goals = {
        ("tp=2 full", "DTensor"): 1.3,
        ("ZeRO-3", "DeepSpeed ZeRO"): 1.3,
        ("pp=2 1f1b (itself)", "Tessera 1F1B"): None,
    }
    lines = PA._table(rows, 3, goals).splitlines()
    assert lines[2] == "| tp=2 full | DTensor | 1.200x | 1.500x | 1.400x | **1.400x** | 1.3x | yes |"
    assert lines[3] == "| ZeRO-3 | DeepSpeed ZeRO | - | - | - | not run | 1.3x | - |"
    assert lines[4] == "| pp=2 1f1b (itself) | Tessera 1F1B | 0.990x | 1.000x | 1.010x | **1.000x** | - | - |"
