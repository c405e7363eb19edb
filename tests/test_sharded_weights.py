"""Hugging Face sharded checkpoints in and out of any layout, one tensor or one stage at a time.

In: a ``LlamaForCausalLM`` saved by ``save_pretrained`` in many small shards with its index
is imported (``Engine.import_weights(folder)``, one parameter at a time) into a model built
without memory (``deferred_parameters``) at tp2 and at pp2; every rank's parameters then
equal the saved model's exactly (a copy and a slice: ``torch.equal``). Out: the trained
engine writes one shard per pipeline stage group and the index (``Engine.export``), and
transformers' ``from_pretrained`` loads the folder; its loss on a batch equals the engine's
(rel 1e-5: the same weights, another summation order across stages and ranks). Each rank
reads each tensor it needs from the files once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, boost, deferred_parameters
from tessera.launcher.checkpoint.tensorfile import LazyTensors

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16


def _config() -> object:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip


def _batch(step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _round_trip(
    rank: int, parallel: ParallelConfig, saved: str, out: str
) -> tuple[dict[str, Tensor], float, int]:
    base = Config(parallel=parallel, train=TrainConfig(precision="fp32"))
    config = dataclasses.replace(base, data=dataclasses.replace(base.data, batch_size=8))
    with deferred_parameters():
        model = transformers.LlamaForCausalLM(_config())
    reads: collections.Counter[str] = collections.Counter()
    read = LazyTensors.__getitem__

    def counted(self: LazyTensors, name: str) -> Tensor:
        reads[name] += 1
        return read(self, name)

    with boost(model, torch.optim.SGD(model.parameters(), lr=0.5), config) as engine:
        with mock.patch.object(LazyTensors, "__getitem__", counted):
            engine.import_weights(saved)
        imported = {n: t.clone() for n, t in engine.full_state_dict().items()}
        engine.train_step(*_batch(0))
        engine.export(out)
        loss = engine.eval_loss(*_batch(1))
    return imported, loss, max(reads.values())


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(tp=2), ParallelConfig(pp=2, microbatches=2, schedule="1f1b")],
    ids=["tp2", "pp2"],
)
def test_a_sharded_checkpoint_loads_into_any_layout_and_exports_for_transformers(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig
) -> None:
    torch.manual_seed(3)
    original = transformers.LlamaForCausalLM(_config())
    saved = tmp_path / "pretrained"
    original.save_pretrained(saved, max_shard_size="20KB")
    assert len(json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(saved.glob("model-*.safetensors"))) > 3  # really sharded
    want = original.state_dict()
    out = tmp_path / "exported"
    results = worker_pools(2).run(_round_trip, parallel, str(saved), str(out), timeout=180)
    for rank, (imported, _, most_reads) in enumerate(results):
        assert imported, f"rank {rank} holds no parameters"
        assert most_reads == 1, f"rank {rank} read a tensor from the files {most_reads} times"
        wrong = [n for n, t in imported.items() if not torch.equal(t, want[n].float())]
        assert not wrong, f"rank {rank}: imported values differ from the checkpoint's for {wrong}"
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shards == [f"model-{k:05d}-of-{parallel.pp:05d}.safetensors" for k in range(1, parallel.pp + 1)]
    _config().save_pretrained(out)  # the model's config beside the weights, as transformers keeps it
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out)
    ids, targets = _batch(1)
    with torch.no_grad():
        theirs = float(F.cross_entropy(reloaded(ids).logits.flatten(0, 1), targets.flatten()))
    ours = results[0][1]
    assert theirs == pytest.approx(ours, rel=1e-5), (theirs, ours)
    assert theirs != pytest.approx(
        float(F.cross_entropy(original(ids).logits.flatten(0, 1), targets.flatten()))
    )


def test_a_folder_without_weights_is_refused_naming_it(tmp_path: Path) -> None:
    from tessera.launcher.checkpoint.tensorfile import weight_files

    with pytest.raises(
        ValueError, match=r"holds neither model\.safetensors\.index\.json nor model\.safetensors"
    ):
        weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-1.safetensors"}}')
    with pytest.raises(ValueError, match="names shards that are missing"):
        weight_files(tmp_path)
