"""Hugging Face MoE checkpoints as ``save_pretrained`` writes them (and as the Hub holds them)
import into ``boost()``'s converted model of every family that converts.

transformers renames and merges a checkpoint's tensors as it loads them, by its conversion
mapping of each family: per-expert ``experts.<e>.gate_proj.weight`` stacked into
``experts.gate_up_proj``, ``backbone.`` read as ``model.`` (Nemotron-H), ``input_linear`` as
``experts.gate_up_proj`` (Granite), a router's ``expert_bias`` as ``e_score_correction_bias``
(HunYuan-V3), Mixtral's ``block_sparse_moe`` as ``mlp``, ... ``save_pretrained`` writes the
older names back. ``import_weights`` reads them as transformers does (``families.hf_names``,
from the pinned transformers' own mapping), each converted bank from its per-expert tensors.

Tier 2 (the worker pool): each family's tiny model (``tessera.launcher.testing_hf_moe``,
weights drawn from seed 0) written by ``save_pretrained``; a model of the same family with
other weights (seed 5) boosted and the folder imported; ``consolidate`` then writes exactly
the original model's state dict (every name, shape and value: ``torch.equal``, since import and
consolidate only copy, slice, stack, concatenate and transpose). One process for every family,
and dp=2 x ep=2 under ZeRO-3 (each rank reading its own experts' tensors) for three of them.
Tensors transformers splits on load (Ling's and Sarvam's ``query_key_value``, Lara's ``in_proj``)
are read by bands, those it joins (Kimi-Linear's and Ling's convolutions) in order, those it
transposes (Ergo's ``gate_kernel``) transposed; another transformation (Inkling 2's
interleaving) is refused naming it (tier 0). Inkling 2's ``save_pretrained`` fails at these
sizes (it pads the vocabulary to 200,000).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import ParallelConfig, boost
from tessera.launcher.checkpoint.exported import Band, ExportPart
from tessera.launcher.families.hf_names import HFNames, hf_renames
from tessera.launcher.testing import oracle_config
from tessera.launcher.testing_hf_moe import tiny_moe_model

pytest.importorskip("transformers", reason="transformers is not installed: HF checkpoints NOT tested")

# the families tests/survey_hf_moe.py converts with transformers' logits
READ = [
    "afmoe", "aria_text", "axk1", "axk2", "cohere2_moe", "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
    "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe",
    "hy_v3", "hy_v4", "jamba", "kolibri1", "laguna", "lfm2_moe", "llama4_text", "longcat_flash", "mellum",
    "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral", "nemotron_h",
    "olmoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "sarvam_mla", "solar_open",
    # tensors transformers splits on load (a fused query_key_value, Lara's in_proj) or joins
    # (three convolutions)
    "bailing_hybrid", "kimi_linear", "lara_mini", "param2moe", "sarvam_moe",
    # matrices it transposes (Ergo's gate_kernel and shared expert); the further families
    "ergo", "inkling_text", "jetmoe", "beam", "kolibri1_1", "qwen4_exp_text", "dots3_note_text",
    "deepseek_v4",
    # the mixture inside its decoder layers (families.hf_gemma4)
    "gemma4_text",
    # routers kept as transformers wrote them (families.hf_moe_kept)
    "phimoe", "zaya",
]  # fmt: skip


def _model(family: str, seed: int) -> Any:
    model = tiny_moe_model(family, seed=seed)
    model.config.use_cache = False
    return model


def _import(rank: int, config: Any, folders: dict[str, str]) -> dict[str, Any]:
    """Each folder imported into its family's model (other weights) boosted under ``config``:
    what ``consolidate`` then writes (rank 0; None elsewhere), or the import's error."""
    out: dict[str, Any] = {}
    for family, folder in folders.items():
        model = _model(family, seed=5)
        engine = boost(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        try:
            engine.import_weights(folder)
            out[family] = engine.consolidate(Path(folder) / "consolidated.safetensors")
        except ValueError as e:
            out[family] = str(e)
        finally:
            engine.mesh.close()
    return out


def _saved(tmp_path: Path, families: list[str]) -> tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]:
    folders, states = {}, {}
    for family in families:
        model = _model(family, seed=0)
        model.save_pretrained(tmp_path / family)
        folders[family] = str(tmp_path / family)
        states[family] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return folders, states


def _check(got: Any, want: dict[str, torch.Tensor], family: str) -> None:
    assert isinstance(got, dict), f"{family}: {got}"
    assert sorted(got) == sorted(want), f"{family}: {sorted(set(got) ^ set(want))}"
    wrong = [n for n in want if got[n].shape != want[n].shape or not torch.equal(got[n], want[n])]
    assert not wrong, f"{family}: {wrong}"


def test_every_converting_familys_save_pretrained_checkpoint_imports_exactly(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    folders, states = _saved(tmp_path, READ)
    config = oracle_config(ParallelConfig(microbatches=1), 0, batch_size=2)
    results = worker_pools(1).run(_import, config, folders, timeout=600)[0]
    for family in READ:
        _check(results[family], states[family], family)


def test_a_split_tensor_is_read_by_bands_and_joined_ones_in_order() -> None:
    """Sarvam's ``query_key_value`` (after the renames: ``.attention.`` is ``.self_attn.``) holds
    q, k and v in rows, sized by the model's projections; Kimi-Linear's ``conv1d`` joins its
    ``q_conv1d``, ``k_conv1d`` and ``v_conv1d``; a transformation import does not make
    (Inkling 2's interleaving) is named for the error."""
    from transformers.core_model_loading import Interleave, WeightConverter

    model = _model("sarvam_moe", seed=0)
    names = hf_renames(model)
    assert names is not None
    q, k = (model.get_parameter(f"model.layers.0.self_attn.{p}_proj.weight").shape[0] for p in "qk")
    fused = "model.layers.0.self_attn.query_key_value.weight"
    assert names.parts("model.layers.0.self_attn.k_proj.weight") == (
        ExportPart(fused, band=Band(-2, q, q + k)),
    )
    assert names("model.layers.0.attention.query_key_value.weight") == fused
    assert names.parts("model.layers.0.self_attn.o_proj.weight") == ()
    kimi = hf_renames(_model("kimi_linear", seed=0))
    assert kimi is not None
    conv = [f"model.layers.0.self_attn.{p}_conv1d.weight" for p in "qkv"]
    assert kimi.parts("model.layers.0.self_attn.conv1d.weight") == tuple(
        ExportPart(n, index=i, joined=True) for i, n in enumerate(conv)
    )
    interleaved = WeightConverter(["experts.w13_weight"], ["experts.gate_up_proj"], [Interleave(1)])
    odd = HFNames(
        renamings=(), converters=(interleaved,), prefix="", shapes={"a.experts.gate_up_proj": (2, 4, 4)}
    )
    why = odd.unread(["a.experts.w13_weight", "a.experts.gate_up_proj"])
    assert "a.experts.w13_weight (Interleave(dim=1) into experts.gate_up_proj)" in why, why
    assert "safetensors.torch.save_file(model.state_dict(), path)" in why, why


@pytest.mark.parametrize("family", ["nemotron_h", "hy_v3", "minimax", "gemma4_text"])
def test_a_save_pretrained_checkpoint_imports_at_dp2_ep2_zero3(
    worker_pools: PoolFactory, tmp_path: Path, family: str
) -> None:
    """Nemotron-H (``backbone.`` for ``model.``, its non-gated experts per expert), HunYuan-V3
    (its router's bias and shared experts renamed), MiniMax (Mixtral's ``block_sparse_moe``),
    Gemma 4 (its mixture moved into its decoder layer's ``moe``): each ep rank reads its own
    experts' tensors, ZeRO-3 shards them."""
    folders, states = _saved(tmp_path, [family])
    config = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), 3, batch_size=4)
    results = worker_pools(config.world_size).run(_import, config, folders, timeout=300)
    _check(results[0][family], states[family], family)
