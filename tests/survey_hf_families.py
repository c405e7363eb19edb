"""A survey, not a test: every causal-LM family of the installed ``transformers`` through
``boost()`` with no plan written, at tp2, pp2 (1F1B), ring (cp2), dp2 and GPipe, against its
serial run. Prints one JSON line per family: ``ok``, ``refused: <first line>`` (a clear error
before or at the first step), ``WRONG`` (trained, but not as serially: the worst case), or
why the family could not be built at a tiny size.

    hatch run python tests/survey_hf_families.py [model_type ...]

Each family is built from its config class with tiny sizes (hidden 32, 4 heads of 8, 2 KV
heads, 2 layers, vocabulary 64; dropouts and router jitters 0: both random in training), trains
2 SGD steps (momentum 0.9, lr 0.5) on 2 gloo processes, and is compared with the same steps in
one process: losses to rel 1e-5, weights to rel 1e-4 of each tensor's largest value (some
families grow a bias to 1e7 in two steps; round-off is then far above any absolute bound), or
to 10 times the serial run's own distance from the same run in fp64 where that is larger
(Gemma 4's steps amplify fp32 round-off to 2e-4 at these sizes: any reordering of its sums moves
its weights that far). Families over 3M parameters at these sizes are skipped (their defaults
keep large widths). Runs serially: 11 minutes for the 200 families of transformers 5.25 on a
2-core machine.
"""

from __future__ import annotations

import json
import resource
import sys
from functools import partial

import torch
from torch import Tensor, nn

from tessera.comm.testing.pool import WorkerPool
from tessera.launcher import Config, ParallelConfig
from tessera.launcher.families.hf_moe import hf_moe_state_dict
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    boosted_run,
    fp64_distance,
    serial_run,
    sgd,
    survey_row,
)

VOCAB, SEQ, BATCH, STEPS, LR = 64, 16, 8, 2, 0.5
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
MODES = {
    "tp2": (ParallelConfig(tp=2), 0),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
    "ring": (ParallelConfig(cp=2), 1),
    "dp2": (ParallelConfig(dp=2), 1),
    "gpipe": (ParallelConfig(pp=2, microbatches=2, schedule="gpipe"), 1),
}


def build(kind: str) -> nn.Module:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = CONFIG_MAPPING[kind](**COMMON)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])(config)  # type: ignore[no-any-return]


def parallel(rank: int, kind: str, config: Config) -> Run:
    return boosted_run(build(kind), TOKENS.first(STEPS), config, sgd(LR))


def _hf_names(kind: str, merged: dict[str, Tensor]) -> dict[str, Tensor]:
    """A mixture boost() converted (tessera.moe names) read back under transformers' names."""
    return hf_moe_state_dict(merged, like=build(kind))


def main(kinds: list[str]) -> None:
    resource.setrlimit(
        resource.RLIMIT_AS, (6 << 30, 6 << 30)
    )  # a large default: MemoryError, not the OOM killer
    pool = WorkerPool(2)
    for kind in kinds:
        try:
            size = sum(p.numel() for p in build(kind).parameters())
            if size > 3_000_000:
                print(json.dumps([kind, f"not run: {size} parameters at the tiny sizes"]), flush=True)
                continue
            want = serial_run(build(kind), TOKENS.first(STEPS), sgd(LR))
            sensitivity = fp64_distance(want, partial(build, kind), TOKENS.first(STEPS), sgd(LR))
        except Exception as exc:
            print(json.dumps([kind, f"not built: {type(exc).__name__}: {str(exc)[:150]}"]), flush=True)
            continue
        row = survey_row(
            pool, parallel, kind, MODES, want, sensitivity, batch_size=BATCH, timeout=120,
            rename=partial(_hf_names, kind),
        )  # fmt: skip
        print(json.dumps([kind, row]), flush=True)
    pool.close()


if __name__ == "__main__":
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    main(sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
