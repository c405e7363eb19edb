"""Low-rank adapters on a mixture's experts and router (`tessera.moe.adapters`).

Tier 0: a layer with adapters computes what the same layer computes with its weights
replaced by ``w + s * (B @ A)^T`` per expert (and the router's ``W + s * B @ A``), written
here with einsum from the adapters' own tensors: outputs, and the gradients of every adapter
tensor; the frozen weights get none. Tier 1 (threads): split over tp inside the experts
(`split_hidden`) and over ep (`shard_experts`), each rank running the same tokens: outputs
equal the serial layer's; the split parts of the adapters hold their slices of the serial
gradients (under ep the owner's gradient sums both ranks' identical tokens: twice the serial
one); the whole parts' gradients summed over the ranks are the serial ones (tp: partial
sums; ep: twice). Refusals name the shapes.

Tolerances, fp32: rtol 1e-5, atol 1e-6 for outputs (the same products summed in another
order: the delta added to the weight before the matmul against after it in the reference's
einsum); gradients rtol 1e-5, atol 1e-5 (sums over up to 48 rows per rank, then ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.func import functional_call

from tessera.comm.testing import run_threaded
from tessera.moe import ExpertAdapter, MoE, RouterAdapter, shard_experts, split_hidden

OUT = {"rtol": 1e-5, "atol": 1e-6}
GRAD = {"rtol": 1e-5, "atol": 1e-5}
D, H, E, R = 8, 12, 4, 3


def _adapted(shared: bool = True) -> MoE:
    """A seeded layer whose weights are frozen, with adapters at both sites (the ``in`` one on
    w1 and w3 through one down projection, as on a fused gate|up weight), on the shared expert's
    w3 alone, and on the router; every tensor drawn (no zero up projections)."""
    layer = MoE(D, H, E, 2, seed=3, shared_hidden=H if shared else None)
    layer.requires_grad_(False)
    gen = torch.Generator().manual_seed(5)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    layer.experts.add_adapter(
        "default",
        ExpertAdapter(draw(E, R, D), {"w1": draw(E, H, R), "w3": draw(E, H, R)}, site="in", scaling=2.0),
    )
    layer.experts.add_adapter(
        "default", ExpertAdapter(draw(E, R, H), {"w2": draw(E, D, R)}, site="out", scaling=2.0)
    )
    if shared:
        assert layer.shared is not None
        layer.shared.add_adapter(
            "default", ExpertAdapter(draw(1, R, D), {"w3": draw(1, H, R)}, site="in", scaling=0.5)
        )
    layer.router.adapters["default"] = RouterAdapter(draw(R, D), draw(E, R), scaling=2.0)
    return layer


def _x() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(2, 6, D, generator=gen), torch.randn(2, 6, D, generator=gen)


def _merged(layer: MoE) -> dict[str, Tensor]:
    """The weights with every adapter added, by einsum from the adapters' tensors."""
    p = dict(layer.named_parameters())
    out = {}
    for bank in ("experts", "shared"):
        if f"{bank}.w1" not in p:
            continue
        for w in ("w1", "w2", "w3"):
            total = p[f"{bank}.{w}"]
            for name, a in p.items():
                if name.startswith(f"{bank}.adapters.") and name.endswith(f".up.{w}"):
                    down = p[name.removesuffix(f".up.{w}") + ".down"]
                    scaling = layer.get_submodule(name.removesuffix(f".up.{w}")).scaling
                    total = total + torch.einsum("eor,eri->eio", a, down) * scaling
            out[f"{bank}.{w}"] = total
    router = layer.router.adapters["default"]
    out["router.weight"] = (
        layer.router.weight + torch.einsum("er,rd->ed", router.up, router.down) * router.scaling
    )
    return out


def test_adapters_add_their_deltas_to_the_weights() -> None:
    layer = _adapted()
    x, g = _x()
    out = layer(x)
    (out * g).sum().backward()
    got = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert set(got) == {n for n in got if ".adapters." in n or n.startswith("router.adapters")}
    params = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in layer.named_parameters()}
    reference = _adapted()
    reference.load_state_dict(params)
    merged = _merged(reference)
    plain = MoE(D, H, E, 2, seed=3, shared_hidden=H)
    want = functional_call(plain, merged, (x,))
    torch.testing.assert_close(out, want, **OUT, msg=lambda m: f"output: {m}")
    (want * g).sum().backward()
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[name], p.grad, **GRAD, msg=lambda m, n=name: f"{n}: {m}")


def _serial() -> dict[str, Any]:
    layer = _adapted(shared=False)
    x, g = _x()
    out = layer(x)
    (out * g).sum().backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad for n, p in layer.named_parameters() if p.grad is not None},
    }


def _split(rank: int, how: str) -> dict[str, Any]:
    layer = _adapted(shared=False)
    (split_hidden if how == "tp" else shard_experts)(layer, dist.group.WORLD)
    x, g = _x()
    out = layer(x)
    (out * g).sum().backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad for n, p in layer.named_parameters() if p.grad is not None},
    }


SPLIT_DIM = {"tp": {"in.up.w1": 1, "in.up.w3": 1, "out.down": 2}, "ep": {}}


@pytest.mark.parametrize("how", ["tp", "ep"])
def test_adapters_split_with_their_experts(how: str) -> None:
    serial = _serial()
    ranks = run_threaded(2, _split, how)
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(
            got["out"], serial["out"], **OUT, msg=lambda m, r=rank: f"rank {r} output: {m}"
        )
    for name, want in serial["grads"].items():
        leaf = name.removeprefix("experts.adapters.default.")
        if how == "ep" and name.startswith("experts."):  # each owner: its experts, both ranks' tokens
            for rank, got in enumerate(ranks):
                mine = 2 * want.chunk(2, 0)[rank]
                torch.testing.assert_close(
                    got["grads"][name], mine, **GRAD, msg=lambda m, n=name, r=rank: f"{n} {r}: {m}"
                )
        elif leaf in SPLIT_DIM[how]:  # tp: this rank's hidden units
            for rank, got in enumerate(ranks):
                mine = want.chunk(2, SPLIT_DIM[how][leaf])[rank]
                torch.testing.assert_close(
                    got["grads"][name], mine, **GRAD, msg=lambda m, n=name, r=rank: f"{n} {r}: {m}"
                )
        else:  # whole: partial sums over tp, or each ep rank's own tokens
            total = sum(got["grads"][name] for got in ranks)
            torch.testing.assert_close(
                total, want if how == "tp" else 2 * want, **GRAD, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_adapters_that_do_not_fit_the_bank_are_refused_naming_the_shapes() -> None:
    layer = MoE(D, H, E, 2, seed=3)
    with pytest.raises(
        ValueError, match=r"down \(4, 3, 12\) and ups \{'w1': 12\} do not fit a bank of 4 experts"
    ):
        layer.experts.add_adapter(
            "x", ExpertAdapter(torch.zeros(E, R, H), {"w1": torch.zeros(E, H, R)}, site="in", scaling=1.0)
        )
    with pytest.raises(ValueError, match=r"site 'in' changes \('w1', 'w3'\), got \['w2'\]"):
        ExpertAdapter(torch.zeros(E, R, D), {"w2": torch.zeros(E, D, R)}, site="in", scaling=1.0)
    layer.experts.add_adapter(
        "x", ExpertAdapter(torch.zeros(E, R, D), {"w1": torch.zeros(E, H, R)}, site="in", scaling=1.0)
    )
    with pytest.raises(ValueError, match=r"already has adapter 'x' under 'in'"):
        layer.experts.add_adapter(
            "x", ExpertAdapter(torch.zeros(E, R, D), {"w3": torch.zeros(E, H, R)}, site="in", scaling=1.0)
        )
