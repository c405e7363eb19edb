"""Tier 0: the core configuration ``boost()`` reads (`BoostConfig`) and the main job's `Config`,
which adds ``[model]`` and ``[data]``: what each validates, and checkpoints across the two."""

from __future__ import annotations

import dataclasses
import json

from tessera.launcher.checkpoint.engine_io import _differences, _fingerprint
from tessera.launcher.config import BoostConfig, Config, ModelConfig, ParallelConfig
from tessera.launcher.config.config_io import config_from_dict, config_to_dict, load_config, resolve_config


def test_the_core_has_no_model_and_the_main_job_config_is_a_core() -> None:
    core = BoostConfig(parallel=ParallelConfig(tp=8))
    assert not hasattr(core, "model") and not hasattr(core, "data")
    assert isinstance(Config(), BoostConfig)
    assert set(config_to_dict(core)) == {"parallel", "zero", "optim", "train", "logging"}
    main_job = {"parallel", "zero", "optim", "train", "logging", "model", "data", "moe", "finetune"}
    assert set(config_to_dict(Config())) == main_job


def test_model_and_data_rules_are_the_main_jobs_only() -> None:
    """tp=8 does not split the reference GPT's 4 heads, and 16 rows do not split into 3 * 4:
    the main job's `Config` refuses both, the core (what boost() checks) neither."""
    parallel = ParallelConfig(tp=8, dp=3)
    config = Config(parallel=parallel)
    lines = config.validate()
    assert "model.n_heads=4 does not split 8 ways (parallel.tp=8)" in lines
    assert any(line.startswith("data.batch_size=16 is not divisible") for line in lines)
    assert BoostConfig.validate(config) == [] and BoostConfig(parallel=parallel).validate() == []
    bad = Config(model=ModelConfig(n_layers=0))
    assert BoostConfig.validate(bad) == [] and bad.validate() == ["model.n_layers must be >= 1, got 0"]


def test_a_script_loads_the_core_rules_the_main_job_the_whole(tmp_path: object) -> None:
    env = {"TESSERA_PARALLEL_TP": "8"}
    assert load_config(env).parallel.tp == 8  # a script's own model is checked by boost()
    assert config_from_dict(config_to_dict(Config(parallel=ParallelConfig(tp=8)))).parallel.tp == 8
    try:
        resolve_config(None, env=env)
    except ValueError as e:
        assert "model.n_heads=4 does not split 8 ways" in str(e)
    else:
        raise AssertionError("the main job's [model] does not split 8 ways")


def test_checkpoints_compare_across_the_core_and_the_main_job_config() -> None:
    """A generation saved from a `BoostConfig` has no ``[model]``: a `Config` with the same core
    resumes it; one saved by a `Config` (its manifest JSON, names as text) resumes into a
    `BoostConfig`; a core difference is still one line."""
    core = BoostConfig(parallel=ParallelConfig(pp=2, schedule="zb-h1"))
    main = Config(parallel=core.parallel)
    saved_core = json.loads(json.dumps(_fingerprint(core)))
    saved_main = json.loads(json.dumps(_fingerprint(main)))
    assert "model" not in saved_core and "data" not in saved_core and "model" in saved_main
    assert _differences(saved_core, _fingerprint(main)) == []
    assert _differences(saved_main, _fingerprint(core)) == []
    other = dataclasses.replace(main, parallel=dataclasses.replace(main.parallel, pp=4))
    assert _differences(saved_core, _fingerprint(other)) == ["parallel.pp: saved 2, now 4"]


def test_the_sequence_must_cut_into_the_context_chunks() -> None:
    """``model.seq_len`` against comm's ``sequence_chunks``: zigzag over cp=2 is 4 chunks, and
    Megatron SP at tp=2 doubles them; the core does not know the sequence."""
    zigzag = ParallelConfig(cp=2, cp_layout="zigzag")  # type: ignore[arg-type]
    config = Config(parallel=zigzag, model=ModelConfig(seq_len=6))
    assert config.validate() == ["model.seq_len=6 does not split into 4 equal chunks (cp=2, layout zigzag)"]
    assert Config(parallel=zigzag, model=ModelConfig(seq_len=8)).validate() == []
    both = ParallelConfig(cp=2, tp=2, sequence_parallel=True)
    line = "model.seq_len=6 does not split into 4 equal chunks (cp=2, layout contiguous, times tp for"
    assert any(e.startswith(line) for e in Config(parallel=both, model=ModelConfig(seq_len=6)).validate())
    assert BoostConfig.validate(config) == []
