"""A survey, not a test: every mixture-of-experts family of the installed ``transformers``
trained through ``boost()`` with no plan written, its mixtures converted by ``boost()`` itself,
at dp2 x ep2 with ZeRO-3, at tp2 (the derived roles: each mixture split inside over tp) and at
pp2 (1F1B, 2 microbatches), against its serial run. Prints one JSON line per family: ``ok``,
``refused: <first line>`` (a clear error before or at the first step), ``WRONG`` (trained, but
not as serially: the worst case), or why the family was not run.

    hatch run python tests/survey_hf_moe_train.py [model_type ...]

Each family is `tessera.launcher.testing_hf_moe`'s tiny model (2 layers, hidden 32, 8 experts
of width 16, top-2, every weight drawn at std 0.3; router jitters 0: random in training, as
dropout), converted (``convert_hf_moe``) for the serial run; both train 2 SGD steps (momentum
0.9, lr 0.1) on 8 rows of 16 tokens, and are compared by ``testing.survey_verdict`` (losses to
rel 1e-5, weights to rel 1e-4 of each tensor's largest value, or 10 times the serial run's own
distance from the same run in fp64). ``tests/test_hf_moe_*.py`` hold each family to its serial
run in the modes they name; this survey says where every family stands in these three.
"""

from __future__ import annotations

import copy
import json
import resource
import sys
from functools import partial
from typing import Any

from torch import nn

from tessera.comm.testing.pool import WorkerPool
from tessera.launcher import ParallelConfig
from tessera.launcher.families.hf_moe import convert_hf_moe
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    boosted_run,
    fp64_distance,
    serial_run,
    sgd,
    survey_row,
)
from tessera.launcher.testing_hf_moe import moe_families, tiny_moe_config, tiny_moe_model

SEQ, BATCH, STEPS, LR = 16, 8, 2, 0.1
TOKENS = RandomTokens(vocab=64, batch=BATCH, seq=SEQ)
MODES = {
    "dp2-ep2-zero3": (ParallelConfig(dp=2, ep=2, microbatches=1), 3),
    "tp2": (ParallelConfig(tp=2, microbatches=1), 0),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
}


def build(kind: str) -> nn.Module:
    """The family's tiny model with every router jitter of its config at 0."""
    config = tiny_moe_config(kind)
    quiet = {k: 0.0 for k, v in vars(config).items() if "jitter" in k and isinstance(v, float) and v}
    model: Any = tiny_moe_model(kind, quiet)
    model.config.use_cache = False
    return model


def converted(kind: str) -> nn.Module:
    model = build(kind)
    convert_hf_moe(model)
    return model


def parallel(rank: int, kind: str, config: Any) -> Run:
    return boosted_run(build(kind), TOKENS.first(STEPS), config, sgd(LR))


def main(kinds: list[str]) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # MemoryError, not the OOM killer
    pool = WorkerPool(2)
    for kind in kinds:
        try:
            model = converted(kind)
            want = serial_run(copy.deepcopy(model), TOKENS.first(STEPS), sgd(LR))
            sensitivity = fp64_distance(want, partial(converted, kind), TOKENS.first(STEPS), sgd(LR))
        except Exception as exc:
            print(json.dumps([kind, f"not run: {type(exc).__name__}: {str(exc)[:150]}"]), flush=True)
            continue
        row = survey_row(pool, parallel, kind, MODES, want, sensitivity, batch_size=BATCH, timeout=180)
        print(json.dumps([kind, row]), flush=True)
    pool.close()


if __name__ == "__main__":
    main(sys.argv[1:] or moe_families())
