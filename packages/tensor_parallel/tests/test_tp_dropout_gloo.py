"""Tier 2: dropout RNG in a parallelized GPT, on 2 gloo processes (one process per rank, so
the split stream that dropout inside attention draws through ``DropoutRNG.fork`` is each
rank's own: threads would share the process-wide generator).

Rank 1's attention heads are made copies of rank 0's, so the two ranks' attention outputs
are equal unless their dropout masks differ: in eval they are equal, in training (split
stream) they differ. Without SP the residual stream is a replicated region whose dropout
(replicated stream) must draw the same masks on both ranks, so every layer's output stays
bitwise equal across ranks. Either way the run is reproducible from the seed, a different
seed changes it, and the global generator is never touched.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.comm import Mesh, Topology
from tessera.comm.testing import GPT, GPTConfig, make_batch
from tessera.comm.testing.fixtures import PoolFactory
from tessera.tensor_parallel import GPT_PLAN, RNGRegion, parallel_gpt_loss, parallelize

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.2)


def _dropout_run(rank: int, sp: bool, seed: int) -> dict[str, Any]:
    serial = GPT(CFG, seed=0)  # (nn.Linear's constructor draws from the global generator)
    half = CFG.d_model // 2
    with torch.no_grad():  # rank 1's heads copy rank 0's, so only dropout can tell them apart
        for layer in serial.layers:
            for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):  # type: ignore[union-attr]
                proj.weight[half:] = proj.weight[:half]
                proj.bias[half:] = proj.bias[:half]
            layer.attn.out_proj.weight[:, half:] = layer.attn.out_proj.weight[:, :half]  # type: ignore[union-attr]
    torch.manual_seed(1234)
    global_state = torch.get_rng_state()
    with Mesh(Topology(tp=2)) as mesh:
        model = parallelize(serial, plan=GPT_PLAN, mesh=mesh, sequence_parallel=sp, seed=seed)
        layer_outputs: list[torch.Tensor] = []
        for layer in model.layers:  # type: ignore[union-attr]
            layer.register_forward_hook(lambda m, a, out: layer_outputs.append(out.detach()))
        heads: list[torch.Tensor] = []  # this rank's attention output in layer 0, train then eval
        model.layers[0].attn.out_proj.register_forward_pre_hook(lambda m, a: heads.append(a[0].detach()))  # type: ignore[index, union-attr]
        idx, targets = make_batch(CFG, 2, seed=0)
        loss = parallel_gpt_loss(model, idx, targets, mesh.group("tp"))
        loss.backward()
        untouched = torch.equal(torch.get_rng_state(), global_state)
        model.eval()
        with torch.no_grad():
            eval_loss = parallel_gpt_loss(model, idx, targets, mesh.group("tp"))
        rng = model.embed.drop.rng  # type: ignore[union-attr]
        draws = {r.value: torch.rand(4, generator=rng.generator(r)) for r in RNGRegion}
    return {
        "loss": loss.item(),
        "eval_loss": eval_loss.item(),
        "layers": layer_outputs[: CFG.n_layers],
        "heads": heads,
        "untouched": untouched,
        "draws": draws,
    }


def test_dropout_streams_in_a_parallel_gpt(worker_pools: PoolFactory) -> None:
    pool = worker_pools(2)
    for sp in (False, True):
        a0, a1 = pool.run(_dropout_run, sp, 5)
        again, _ = pool.run(_dropout_run, sp, 5)
        other, _ = pool.run(_dropout_run, sp, 6)
        assert a0["untouched"] and a1["untouched"]  # nothing drew from the global generator
        assert a0["loss"] == a1["loss"] and a0["loss"] != a0["eval_loss"]  # dropout is active
        assert again["loss"] == a0["loss"] and other["loss"] != a0["loss"]  # reproducible from the seed
        assert torch.equal(a0["draws"]["replicated"], a1["draws"]["replicated"])
        assert not torch.equal(a0["draws"]["split"], a1["draws"]["split"])
        # identical heads on both ranks: equal without dropout, different under the split stream
        assert torch.equal(a0["heads"][1], a1["heads"][1])
        assert not torch.allclose(a0["heads"][0], a1["heads"][0])
        if not sp:  # the replicated residual stream is bitwise equal on both ranks
            for x0, x1 in zip(a0["layers"], a1["layers"], strict=True):
                assert torch.equal(x0, x1)
        else:  # each rank holds a different slice of the sequence
            assert a0["layers"][0].shape[1] == CFG.seq_len // 2
