"""LoRA fine-tuning on 2 gloo processes: Tessera with a PEFT model through ``boost()`` beside a
full fine-tune of the same model in the same layout, torch + peft in one process, and DeepSpeed
ZeRO-3 + peft on 2 processes, in one run on the same model, batch and adapters.

The model (``_lora_model.py``): a Llama-shaped Hugging Face ``LlamaForCausalLM`` built from its
config in bf16 (124.7M parameters: d=768, 12 layers, GQA 12/4 heads, SwiGLU 2048, vocabulary
32,000; random weights, nothing downloaded), LoRA rank 16 (alpha 32) on every linear layer of
the blocks (2.6M trainable parameters), AdamW, gradient clipping at norm 1, one global batch of
``--rows`` x ``--seq`` tokens (4 x 128) every step. Sized so that each configuration trains in
about 20 s of processes here (the default run: 8 configurations, 2 rounds, under 5 minutes),
yet large enough that model state, not the interpreter, sets the memory: the full fine-tune
holds 1.1 GB of fp32 masters, gradients and moments per rank under ZeRO-3.

Systems (``_lora_ranks.py`` says how each is set up), each configuration a fresh set of
processes (so each peak resident set is its own):

- ``tessera-lora`` / ``tessera-full`` in each of ``--layouts`` (``dp2-zero3``: dp=2 with ZeRO
  stage 3, the natural LoRA layout; ``dp2-zero1``: stage 1, every rank holding the whole
  base; ``tp2``: 1D tensor parallelism; ``tp2-sp``: with sequence parallelism),
  ``train.precision`` bf16 (frozen parameters keep only their bf16 values);
- ``torch-peft``: the PEFT model in one process, no process group, with ``--peft-threads``
  intra-op threads (default 2: the cores the 2 ranks use);
- ``deepspeed-peft``: DeepSpeed ZeRO-3 (bf16, torch AdamW as its client optimizer) on 2
  processes, in DeepSpeed's own Python (``benchmarks/out/peers/deepspeed``, made on first use
  by ``peers.py``; ``peft`` and ``transformers`` added to it at this Python's versions:
  ``_lora_peers.py``). When it cannot run, its line says why (``status``).

Figures per configuration (one JSON line each): ``trainable_params``, ``params``,
``peak_rss_mb`` (the largest over the ranks of ``VmHWM`` from the start through the warm-up,
the build included; ``peak_rss_mb_per_rank``), ``train_peak_rss_mb`` (over the warm-up steps
after the first: steady training), ``phase_peak_rss_mb`` (the peak of each phase: imports,
build, wrap, first_step, train; ``_lora_ranks.py``), ``base_rss_mb`` (after the imports,
before the build), ``model_state_bytes`` per rank (parameters + gradients + optimizer state by
``tessera.comm.measure_memory``: Tessera's ``Engine.zero.memory()``; none for DeepSpeed),
``comm_bytes`` (Tessera's, per step and rank, by ``CommMeter``), ``step_time_s`` (the median
over the timed steps of the slowest rank, then the median over ``--rounds``), ``tokens_per_s``
(the global batch's tokens over it), ``first_loss`` and ``final_loss``. With ``--rounds`` > 1
the configurations run round-robin, the order rotated each round. Tessera's LoRA lines carry
the ratios (``vs_full``, ``vs_torch_peft``, ``vs_deepspeed_peft``): ``rss`` and ``train_rss``
(peak per rank over the other's; below 1: Tessera holds less), ``state`` (model-state bytes,
likewise) and ``speed`` (tokens/s over the other's; above 1: Tessera is faster). A table of
them goes to stderr.

Python: the Tessera ranks and torch + peft need ``peft`` and ``transformers``, which the default
hatch environment does not list; ``--python`` names an interpreter that has them, else this
one if it does, else the ``hatch-test`` environment's (``_lora_peers.lora_python``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from _common import emit, table
from _common import run_ranks as common_run_ranks
from _lora_model import LoraSize
from _lora_peers import deepspeed_python, lora_python, versions
from _lora_ranks import LAYOUTS, add_size_args

HERE = Path(__file__).resolve().parent
RANKS = HERE / "_lora_ranks.py"
PEERS = ("torch-peft", "deepspeed-peft")
Key = tuple[str, str]  # (system, layout)


def run_ranks(
    python: str, flags: list[str], world: int, threads: int, timeout: float
) -> list[dict[str, Any]] | str:
    """``_lora_ranks.py`` as ``world`` processes of ``python`` (``_common.run_ranks``), each with
    ``threads`` intra-op threads, in a folder of their own (DeepSpeed and PEFT may write beside
    the working directory)."""
    env = {"OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(HERE)}
    cmd = [python, str(RANKS), *flags, "--threads", str(threads)]
    return common_run_ranks(cmd, env, world, timeout, cwd_in_store=True)


def _configs(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(system, layout, processes) of every configuration asked for, in the first round's order."""
    systems = [s for s in args.systems.split(",") if s]
    out = []
    for layout in [la for la in args.layouts.split(",") if la]:
        out += [(s, layout, 2) for s in ("tessera-lora", "tessera-full") if s in systems]
    if "torch-peft" in systems:
        out.append(("torch-peft", "1 process", 1))
    if "deepspeed-peft" in systems:
        out.append(("deepspeed-peft", "dp2-zero3", 2))
    return out


def _record(
    args: argparse.Namespace, size: LoraSize, key: Key, world: int, runs: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    """The configuration's JSON line from its rounds (each: every rank's line)."""
    system, layout = key
    steps = [max(r["step_time_s"] for r in ranks) for ranks in runs]  # the slowest rank sets the step
    step = statistics.median(steps)
    per_rank = [max(ranks[i]["peak_rss_mb"] for ranks in runs) for i in range(world)]
    train_per_rank = [max(ranks[i]["train_peak_rss_mb"] for ranks in runs) for i in range(world)]
    first = runs[0][0]
    rec: dict[str, Any] = {
        "bench": "lora",
        "system": system,
        "layout": layout,
        "config": f"{size.label()} {size.lora_label() if system != 'tessera-full' else 'full'} world={world}",
        "step_time_s": round(step, 4),
        "tokens_per_s": round(size.rows * size.seq / step, 1),
        "trainable_params": first["trainable_params"],
        "params": first["params"],
        "peak_rss_mb": max(per_rank),
        "peak_rss_mb_per_rank": per_rank,
        "train_peak_rss_mb": max(train_per_rank),
        "train_peak_rss_mb_per_rank": train_per_rank,
        "base_rss_mb": first["base_rss_mb"],
        "phase_peak_rss_mb": {
            phase: max(r["phase_peak_rss_mb"][phase] for ranks in runs for r in ranks)
            for phase in first["phase_peak_rss_mb"]
        },
        "model_state_bytes": max((r.get("model_state_bytes") or 0) for r in runs[0]) or None,
        "state_bytes": first.get("state_bytes"),
        "comm_bytes": first.get("comm_bytes"),
        "first_loss": first["losses"][0],
        "final_loss": first["losses"][-1],
        "step_time_s_by_round": [round(s, 4) for s in steps],
        "setup_s": max(r["setup_s"] for r in runs[0]),
    }
    if system == "torch-peft":
        rec["threads"] = args.peft_threads
    return rec


def _ratios(ours: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """``ours`` over ``other``: memory (below 1: ours holds less) and speed (above 1: ours is faster)."""

    def over(key: str) -> float | None:
        a, b = ours.get(key), other.get(key)
        return round(a / b, 3) if a and b else None

    return {
        "rss": over("peak_rss_mb"),
        "train_rss": over("train_peak_rss_mb"),
        "state": over("model_state_bytes"),
        "speed": over("tokens_per_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_args(parser)
    parser.add_argument("--layouts", default="dp2-zero3,dp2-zero1,tp2", help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument(
        "--systems", default="tessera-lora,tessera-full,torch-peft,deepspeed-peft", help="comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=2, help="round-robin repeats of every configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (memory is read over them)")
    parser.add_argument("--iters", type=int, default=4, help="timed steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--peft-threads", type=int, default=2, help="torch-peft's intra-op threads")
    parser.add_argument("--python", default=None, help="an interpreter with Tessera, peft and transformers")
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    args = parser.parse_args()
    unknown = sorted({la for la in args.layouts.split(",") if la} - set(LAYOUTS))
    unknown += sorted({s for s in args.systems.split(",") if s} - {"tessera-lora", "tessera-full", *PEERS})
    if unknown:
        parser.error(f"unknown layouts or systems {unknown}")
    if args.warmup < 2 or args.iters < 1 or args.rounds < 1:
        parser.error(
            f"need --warmup >= 2, --iters >= 1, --rounds >= 1; got {args.warmup}, {args.iters}, {args.rounds}"
        )
    size = LoraSize(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        ffn=args.ffn, rank=args.lora_rank, alpha=args.lora_alpha, seq=args.seq, rows=args.rows,
    )  # fmt: skip
    python = lora_python(args.python)
    if python.startswith("not available"):
        raise SystemExit(f"bench lora: {python}")
    pins = versions(python)
    configs = _configs(args)
    interpreters = {key: python for key in configs}
    failed: dict[Key, str] = {}
    versions_of: dict[str, str] = {}
    for system, layout, world in configs:
        if system == "deepspeed-peft":
            ds, note = deepspeed_python(args.deepspeed_python, pins)
            if ds:
                versions_of[system] = note
            else:
                failed[(system, layout)] = note
            interpreters[(system, layout, world)] = ds
    size_flags = [
        f"--{k}={v}"
        for k, v in {
            "vocab": size.vocab, "dim": size.dim, "layers": size.layers, "heads": size.heads,
            "kv-heads": size.kv_heads, "ffn": size.ffn, "lora-rank": size.rank, "lora-alpha": size.alpha,
            "seq": size.seq, "rows": size.rows, "warmup": args.warmup, "iters": args.iters, "lr": args.lr,
        }.items()
    ]  # fmt: skip
    runs: dict[Key, list[list[dict[str, Any]]]] = {}
    for r in range(args.rounds):
        for system, layout, world in configs[r % len(configs) :] + configs[: r % len(configs)]:
            key = (system, layout)
            if key in failed:
                continue
            flags = [f"--system={system}", *size_flags]
            flags += [f"--layout={layout}"] if system.startswith("tessera") else []
            threads = args.peft_threads if system == "torch-peft" else 1
            got = run_ranks(interpreters[(system, layout, world)], flags, world, threads, args.timeout)
            if isinstance(got, str):
                failed[key] = got
            else:
                runs.setdefault(key, []).append(sorted(got, key=lambda rec: int(rec["rank"])))
    records: dict[Key, dict[str, Any]] = {}
    for system, layout, world in configs:
        key = (system, layout)
        if key in runs:
            records[key] = _record(args, size, key, world, runs[key])
        else:
            records[key] = {
                "bench": "lora", "system": system, "layout": layout,
                "config": f"{size.label()} {size.lora_label()} world={world}",
                "step_time_s": None, "tokens_per_s": None, "status": failed.get(key, "not run"),
            }  # fmt: skip
        if system in versions_of:
            records[key]["version"] = versions_of[system]
    _add_ratios(records)
    for rec in records.values():
        emit(rec)
    _tables(list(records.values()))


def _add_ratios(records: dict[Key, dict[str, Any]]) -> None:
    """Each Tessera LoRA line's ratios against the full fine-tune of its layout and the peers."""
    peers = {
        "vs_torch_peft": records.get(("torch-peft", "1 process")),
        "vs_deepspeed_peft": records.get(("deepspeed-peft", "dp2-zero3")),
    }
    for (system, layout), rec in records.items():
        if system != "tessera-lora" or rec["step_time_s"] is None:
            continue
        full = records.get(("tessera-full", layout))
        if full is not None and full["step_time_s"] is not None:
            rec["vs_full"] = _ratios(rec, full)
        for name, peer in peers.items():
            if peer is not None and peer["step_time_s"] is not None:
                rec[name] = _ratios(rec, peer)


def _tables(records: list[dict[str, Any]]) -> None:
    ran = [r for r in records if r["step_time_s"] is not None]
    for r in ran:
        for key in ("model_state", "comm"):
            value = r.get(f"{key}_bytes")
            r[f"{key}_mb"] = round(value / 2**20, 1) if value else ""
    keys = ("system", "layout", "trainable_params", "peak_rss_mb_per_rank", "train_peak_rss_mb")
    if ran:
        table([dict(r) for r in ran], (*keys, "model_state_mb", "comm_mb", "tokens_per_s", "final_loss"))
    for r in records:
        if r["step_time_s"] is None:
            print(f"{r['system']} ({r['layout']}): {r['status']}", file=sys.stderr)
    rows = [
        {"tessera-lora": r["layout"], "against": name.removeprefix("vs_"), **r[name]}
        for r in ran
        for name in ("vs_full", "vs_torch_peft", "vs_deepspeed_peft")
        if name in r
    ]
    if rows:
        print(file=sys.stderr)
        table(rows, ("tessera-lora", "against", "rss", "train_rss", "state", "speed"))


if __name__ == "__main__":
    main()
