"""Tier 2: dropout RNG in a parallelized GPT, on 2 gloo processes (one process per rank, so
the split stream that dropout inside attention draws through ``DropoutRNG.fork`` is each
rank's own: threads would share the process-wide generator).

Rank 1's attention heads are made copies of rank 0's, so the two ranks' attention outputs
are equal unless their dropout masks differ: in eval they are equal, in training (split
stream) they differ. Without SP the residual stream is a replicated region whose dropout
(replicated stream) must draw the same masks on both ranks, so every layer's output stays
bitwise equal across ranks. Either way the run is reproducible from the seed, a different
seed changes it, and the global generator is never touched.

Values against the serial oracle: dropout masks have no serial twin (the serial model draws
from the global generator), so every layer's output and the loss are compared in eval mode:
with SP each rank's layer output is its slice of the sequence of the serial layer's output,
without SP the whole of it. Tolerance rtol=1e-5, atol=1e-6: the layer outputs are ~0.1 (the
residual stream at init) and the parallel model sums each row-parallel product over 2 ranks
where the serial one sums it in one matmul, fp32 round-off measured at ~3e-8; a wrong slice
of the sequence or a missed reduction is off by ~0.1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tessera.comm import Mesh, Topology
from tessera.comm.testing.fixtures import PoolFactory
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel import GPT_PLAN, RNGRegion, parallel_gpt_loss, parallelize

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.2)
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring


def _model() -> GPT:
    """The GPT whose rank-1 attention heads (under tp=2) copy rank 0's."""
    model = GPT(CFG, seed=0)  # (nn.Linear's constructor draws from the global generator)
    half = CFG.d_model // 2
    with torch.no_grad():
        for layer in model.layers:
            for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):  # type: ignore[union-attr]
                proj.weight[half:] = proj.weight[:half]
                proj.bias[half:] = proj.bias[:half]
            layer.attn.out_proj.weight[:, half:] = layer.attn.out_proj.weight[:, :half]  # type: ignore[union-attr]
    return model


def _record_layers(model: nn.Module) -> list[Tensor]:
    """A list that collects the output of every transformer layer of ``model``, in call order."""
    outputs: list[Tensor] = []
    for layer in model.layers:  # type: ignore[union-attr]
        layer.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    return outputs


def _dropout_run(rank: int, sp: bool, seed: int) -> dict[str, Any]:
    serial = _model()
    torch.manual_seed(1234)
    global_state = torch.get_rng_state()
    with Mesh(Topology(tp=2)) as mesh:
        model = parallelize(serial, plan=GPT_PLAN, mesh=mesh, sequence_parallel=sp, seed=seed)
        layer_outputs = _record_layers(model)
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
        "eval_layers": layer_outputs[CFG.n_layers :],
        "heads": heads,
        "untouched": untouched,
        "draws": draws,
    }


def test_dropout_streams_in_a_parallel_gpt(worker_pools: PoolFactory) -> None:
    serial = _model().eval()
    serial_layers = _record_layers(serial)
    idx, targets = make_batch(CFG, 2, seed=0)
    with torch.no_grad():
        serial_loss = serial.loss(idx, targets)
    assert len(serial_layers) == CFG.n_layers
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
        # without dropout, every rank holds the serial values (SP: its slice of the sequence)
        for rank, got in enumerate((a0, a1)):
            torch.testing.assert_close(torch.tensor(got["eval_loss"]), serial_loss, **TOL)
            assert len(got["eval_layers"]) == CFG.n_layers
            for layer_out, want in zip(got["eval_layers"], serial_layers, strict=True):
                torch.testing.assert_close(layer_out, want.chunk(2, 1)[rank] if sp else want, **TOL)
