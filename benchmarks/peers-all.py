"""Every parallel mode beside its natural peer, on one model, in one run, in one table.

    hatch run bench peers-all [-- --rounds 3 --iters 8]

Round by round (``--rounds``), each of these benchmarks runs once, as its own processes, on
the same reference GPT (``--d-model``, ``--heads``, ``--layers``, ``--vocab``, ``--seq``;
d=256, 8 heads, 4 layers, V=4096, 64 positions by default) with the same ``--warmup`` and
``--iters``; inside each, the systems of a pair alternate step by step (the peers that run in
another Python, DeepSpeed's, run right after their pair, on the same batches):

- ``tp``: tensor parallelism over 2 ranks, Tessera beside DTensor's ``parallelize_module``,
  the ``blocks`` and ``full`` plans (``--tp-batch`` sequences, both ranks the same);
- ``zero``: ZeRO-1 and ZeRO-2 beside torch DDP and DeepSpeed ZeRO-1 / ZeRO-2, ZeRO-3 beside
  FSDP2 ``fully_shard`` and DeepSpeed ZeRO-3 (``--zero-batch`` sequences per rank);
- ``pipeline``: p=2, m=8 microbatches of ``--microbatch``: each Tessera schedule beside
  ``torch.distributed.pipelining``'s (GPipe, 1F1B, interleaved 1F1B, ZBV; ZB-H1 beside
  torch's 1F1B and interleaved zero-bubble), and Tessera's zero-bubble schedules beside its
  own 1F1B, as ``boost()`` runs them (``+tune``) and as built;
- ``moe``: the same GPT with every MLP a mixture (8 experts, top 2), expert parallelism over 2
  ranks beside DeepSpeed-MoE (``--moe-batch`` sequences in all).

A pair's ratio is the peer's step time over Tessera's in the same round: above 1, Tessera
is faster; both count the same tokens. The table gives every round's ratio, their median and
the goal: 1.3 where the peer is another system than DDP, 1.0 beside DDP and beside Tessera's
own 1F1B (1F1B beside itself, the noise floor of such a pair, has none). The run folder
(``--out``, default ``benchmarks/out/peers-all-<UTC time>``, git-ignored) receives
``records.jsonl`` (every benchmark record, with its ``round``), ``<bench>-round<r>.log``
(each run's stderr) and ``table.md``, which is also printed. A peer that cannot run (no
DeepSpeed environment: ``hatch run bench peers`` makes it) gets a row saying why, and no
ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
Record = dict[str, Any]


@dataclass(frozen=True)
class Pair:
    """One comparison: Tessera's record and its peer's, from one benchmark run."""

    mode: str
    peer: str
    ours: Record
    theirs: Record

    @property
    def ratio(self) -> float | None:
        a, b = self.ours.get("step_time_s"), self.theirs.get("step_time_s")
        return round(b / a, 3) if a and b else None

    @property
    def goal(self) -> float | None:
        """1.3 beside another system, 1.0 beside DDP and Tessera's own 1F1B; none for 1F1B beside
        itself (the noise floor of a pair)."""
        if self.mode.endswith("(itself)"):
            return None
        return 1.0 if self.peer in ("torch DDP", "Tessera 1F1B") else 1.3


def _by_config(records: list[Record]) -> dict[str, dict[str, Record]]:
    groups: dict[str, dict[str, Record]] = {}
    for rec in records:
        groups.setdefault(rec["config"], {})[rec["system"]] = rec
    return groups


def _tp_pairs(records: list[Record]) -> Iterator[Pair]:
    for config, systems in _by_config(records).items():
        plan = config.split("plan=")[1].split()[0]
        if "tessera" in systems and "torch-dtensor" in systems:
            yield Pair(f"tp=2 {plan}", "DTensor", systems["tessera"], systems["torch-dtensor"])


def _zero_pairs(records: list[Record]) -> Iterator[Pair]:
    names = {"torch-ddp": "torch DDP", "torch-fsdp2": "FSDP2", "deepspeed-zero": "DeepSpeed ZeRO"}
    stages: dict[str, list[Record]] = {}
    for rec in records:
        stages.setdefault(rec["config"].split()[0], []).append(rec)
    for stage, group in stages.items():
        if stage == "stage=none":
            continue
        ours = next(r for r in group if r["system"] == "tessera")
        for rec in group:
            if rec["system"] in names:
                yield Pair(f"ZeRO-{stage.split('=')[1]}", names[rec["system"]], ours, rec)


def _pipeline_pairs(records: list[Record]) -> Iterator[Pair]:
    for config, systems in _by_config(records).items():
        if "tessera" not in systems or ": " not in config:
            continue
        label = config.split(": ", 1)[1]  # "tessera zb-h1 vs torch Schedule1F1B"
        ours, _, theirs = label.removeprefix("tessera ").partition(" vs ")
        if "torch-pipelining" in systems:
            peer = f"torch {theirs.removeprefix('torch ')}"
            yield Pair(f"pp=2 {ours}", peer, systems["tessera"], systems["torch-pipelining"])
        elif "tessera-1f1b" in systems:  # 1F1B beside itself: the noise floor of such a pair
            mode = "pp=2 1f1b (itself)" if ours == "1f1b" else f"pp=2 {ours}"
            yield Pair(mode, "Tessera 1F1B", systems["tessera"], systems["tessera-1f1b"])


def _moe_pairs(records: list[Record]) -> Iterator[Pair]:
    systems = {r["system"]: r for r in records}
    if "tessera-ep" in systems and "deepspeed-moe" in systems:
        yield Pair("MoE ep=2", "DeepSpeed-MoE", systems["tessera-ep"], systems["deepspeed-moe"])


@dataclass(frozen=True)
class Part:
    bench: str
    flags: Callable[[argparse.Namespace], list[str]]
    pairs: Callable[[list[Record]], Iterator[Pair]]


def _shape(a: argparse.Namespace, *, seq: str = "--seq") -> list[str]:
    return [
        f"--d-model={a.d_model}", f"--heads={a.heads}", f"--layers={a.layers}", f"--vocab={a.vocab}",
        f"{seq}={a.seq}", f"--warmup={a.warmup}", f"--iters={a.iters}",
    ]  # fmt: skip


PARTS = {
    "tp": Part("tp", lambda a: [*_shape(a), f"--batch={a.tp_batch}"], _tp_pairs),
    "zero": Part(
        "zero",
        lambda a: [*_shape(a), f"--batch={a.zero_batch}", "--stages", "1", "2", "3", "--deepspeed"],
        _zero_pairs,
    ),
    "pipeline": Part(
        "pipeline",
        lambda a: [*_shape(a, seq="--seq-len"), "--part=gpt", f"--microbatch={a.microbatch}"],
        _pipeline_pairs,
    ),
    "moe": Part("moe", lambda a: [*_shape(a), f"--batch={a.moe_batch}"], _moe_pairs),
}


def _run(part: Part, args: argparse.Namespace, log: Path) -> list[Record]:
    """One run of ``part``'s benchmark: its JSON records (its stderr into ``log``)."""
    cmd = [sys.executable, str(HERE / "run.py"), part.bench, *part.flags(args)]
    if args.deepspeed_python and part.bench in ("zero", "moe"):
        cmd.append(f"--deepspeed-python={args.deepspeed_python}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[1:])} failed ({done.returncode}); see {log}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _table(
    rows: dict[tuple[str, str], list[float | None]], rounds: int, goals: dict[tuple[str, str], float | None]
) -> str:
    head = ["mode", "peer", *(f"round {r + 1}" for r in range(rounds)), "median", "goal", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (mode, peer), ratios in rows.items():
        got = [r for r in ratios if r is not None]
        median = statistics.median(got) if got else None
        cells = [f"{r:.3f}x" if r is not None else "-" for r in ratios]
        goal = goals[(mode, peer)]
        met = "-" if median is None or goal is None else ("yes" if median >= goal else "no")
        shown = f"**{median:.3f}x**" if median is not None else "not run"
        wanted = "-" if goal is None else f"{goal:g}x"
        lines.append("| " + " | ".join([mode, peer, *cells, shown, wanted, met]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tp-batch", type=int, default=8)
    parser.add_argument("--zero-batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--microbatch", type=int, default=4, help="sequences per pipeline microbatch")
    parser.add_argument("--moe-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--deepspeed-python", default=None, help="an interpreter with deepspeed")
    parser.add_argument("--out", default=None, help="the run folder")
    args = parser.parse_args()
    out = Path(args.out or HERE / "out" / f"peers-all-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str], list[float | None]] = {}
    goals: dict[tuple[str, str], float | None] = {}
    with (out / "records.jsonl").open("w") as sink:
        for r in range(args.rounds):
            for name in args.parts:
                t0 = time.perf_counter()
                records = _run(PARTS[name], args, out / f"{name}-round{r + 1}.log")
                sink.writelines(json.dumps({**rec, "round": r + 1}) + "\n" for rec in records)
                for pair in PARTS[name].pairs(records):
                    key = (pair.mode, pair.peer)
                    rows.setdefault(key, [None] * args.rounds)[r] = pair.ratio
                    goals[key] = pair.goal
                print(
                    f"round {r + 1}: {name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True
                )
    shape = (
        f"GPT d={args.d_model} heads={args.heads} L={args.layers} V={args.vocab} seq={args.seq}, "
        f"{args.rounds} rounds, warmup {args.warmup}, iters {args.iters}; ratio = peer step / Tessera step"
    )
    text = f"{shape}\n\n{_table(rows, args.rounds, goals)}\n"
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
