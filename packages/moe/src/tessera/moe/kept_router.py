"""A router kept as its author wrote it: any module, read through an adapter, in the place of
`tessera.moe.router.TopKRouter` in an `MoE` layer.

Some routers cannot be re-implemented as a `RouterSpec` says (PhiMoE's sampled sparsemixer with
its own backward, ZAYA's MLP router carrying a state from layer to layer); what the layer needs
of a router is only each token's choices and their weights. `KeptRouter` holds the module as it
is (its parameters and buffers under ``module``, trained by its own autograd, replicated on every
rank as any router is) and an `Adapter` that calls it and says what it chose: ``choices [N, k]``
(int64 indices of the ``E`` experts), their ``weights [N, k]`` and the ``logits [N, E']`` the
layer's auxiliary losses read (``E' >= E``: logits beyond the ``E`` experts, a skip expert's, are
left out of the losses' probabilities), a state to carry to the next layer's router (ZAYA's;
None for most), and the tokens the experts read where the router's call changes them (PhiMoE's
input jitter, which transformers applies in place to the tokens both read; None for most). It is
called as any router of an `MoE` is, ``router(x, input_ids, tp_group=..., carried=...)`` (the ids
unread), and gives the state and the tokens back in its `Routing` (``carried``, ``inputs``). The
layer's dispatch, expert parallelism, tp split and export are those of any `MoE`.

A router that samples (``sampling`` names what makes it random, "" when it is not) is random in
training like dropout. Under tensor parallelism inside the experts every tp rank routes the same
whole tokens and must choose the same experts, else each sums its share of other experts: in
training such a router is called, on every tp rank, under a generator seeded with a seed drawn
from the group's first rank's global generator and broadcast over the group (one int64; the
global generators are put back as they were, advanced by the seed's draw), so the tp ranks draw
the same samples. An activation recompute replays the global generator (torch's checkpoint), so
the first rank draws the same seed again and the same samples follow. Without tp (tp=1, or the
experts split over ep only) the module is called as it is, drawing from the global generator as
its own model would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.comm import broadcast, group_size
from tessera.moe.router import Routing

__all__ = ["Adapter", "KeptChoice", "KeptRouter"]


@dataclass(frozen=True, slots=True)
class KeptChoice:
    """What a kept router chose for ``N`` tokens: ``choices [N, k]`` (indices of the layer's
    experts), ``weights [N, k]`` (differentiable as the router made them), ``logits [N, E']`` (for
    the layer's losses; ``E' >= E``), ``carried``: the state for the next layer's router (or None),
    ``inputs [N, d]``: the tokens the experts read, where the call changed them (or None)."""

    choices: Tensor
    weights: Tensor
    logits: Tensor
    carried: Tensor | None = None
    inputs: Tensor | None = None


Adapter = Callable[[nn.Module, Tensor, Tensor | None], KeptChoice]
"""``adapter(module, x, carried) -> KeptChoice``: calls the kept router ``module`` on the layer's
input ``x [..., d]`` (its leading shape as the layer was given it) and the state ``carried`` from
the previous layer's router (None where there is none), and says what it chose."""


class KeptRouter(nn.Module):
    """``x [..., d] -> Routing`` by a module kept as it is (module docstring): ``module`` (its
    tensors under ``module.``), ``adapter`` (`Adapter`), ``experts`` the layer's ``E``,
    ``top_k``, ``sampling``: what makes the router random in training ("" when nothing does).
    ``forward(x, input_ids, tp_group=..., carried=...)``: ``carried`` the previous layer's router's
    state (None by default), ``input_ids`` unread; the `Routing` holds the state this call made
    (``carried``) and the tokens it gave the experts (``inputs``: `KeptChoice.inputs`, else ``x``
    flattened). Under a tp group a sampling router in training draws the group's first rank's
    samples on every rank."""

    tid2eid: Tensor | None = None  # what `TopKRouter` may hold and an `MoE` asks of its router
    score_bias: Tensor | None = None

    def __init__(
        self, module: nn.Module, adapter: Adapter, experts: int, top_k: int, *, sampling: str = ""
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
        self.module, self.adapter = module, adapter
        self.experts, self.top_k, self.sampling = experts, top_k, sampling
        self.adapters = nn.ModuleDict()  # no low-rank router adapters on a kept router

    def forward(
        self,
        x: Tensor,
        input_ids: Tensor | None = None,
        *,
        tp_group: dist.ProcessGroup | None = None,
        carried: Tensor | None = None,
    ) -> Routing:
        tokens = x.reshape(-1, x.shape[-1])  # what the experts read unless the call changes them
        if self.sampling and self.training and tp_group is not None and group_size(tp_group) > 1:
            chose = self._same_draws(x, tp_group, carried)
        else:
            chose = self.adapter(self.module, x, carried)
        n = tokens.shape[0]
        shape = (n, self.top_k)
        if tuple(chose.choices.shape) != shape or tuple(chose.weights.shape) != shape:
            raise ValueError(
                f"the kept router {type(self.module).__name__} chose {tuple(chose.choices.shape)} experts "
                f"with weights {tuple(chose.weights.shape)}, not [tokens, top_k] = {list(shape)}"
            )
        if chose.logits.dim() != 2 or chose.logits.shape[1] < self.experts:
            raise ValueError(
                f"the kept router {type(self.module).__name__} gave logits {tuple(chose.logits.shape)}, not "
                f"[tokens, >= experts ({self.experts})]"
            )
        if chose.inputs is not None and tuple(chose.inputs.shape) != tuple(tokens.shape):
            raise ValueError(
                f"the kept router {type(self.module).__name__} gave the experts inputs "
                f"{tuple(chose.inputs.shape)}, not [tokens, d] = {list(tokens.shape)}"
            )
        probs = torch.softmax(chose.logits.float(), dim=-1)[:, : self.experts]
        return Routing(
            logits=chose.logits[:, : self.experts],
            probs=probs,
            choices=chose.choices.long(),
            weights=chose.weights,
            carried=chose.carried,
            inputs=tokens if chose.inputs is None else chose.inputs,
        )

    def _same_draws(self, x: Tensor, group: dist.ProcessGroup, carried: Tensor | None) -> KeptChoice:
        """The adapter's call under a generator seeded by the group's first rank (module docstring)."""
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if x.device.type != "cpu":  # a collective of the device's backend moves device tensors
            seed = seed.to(x.device)
        seed = broadcast(seed, 0, group)
        kind = x.device.type
        devices = [] if kind == "cpu" else [x.device]
        with torch.random.fork_rng(devices=devices, device_type=kind if devices else "cuda"):
            value = int(seed.item())
            torch.default_generator.manual_seed(value)
            if devices:  # the generator of x's device, where the router draws its samples
                with torch.get_device_module(kind).device(x.device):
                    torch.get_device_module(kind).manual_seed(value)
            return self.adapter(self.module, x, carried)
