"""The model the planner plans for: a decoder-only GPT given by its sizes, and what each rank
holds of it.

`ModelShape` holds the sizes of a GPT shaped like the reference GPT of ``tessera.models``
(learned positions, pre-norm layers, separate q/k/v/out projections with biases, an MLP of
``mlp_ratio``, an untied LM head) and the global batch; a GPT-3-sized model is the same
shape with bigger numbers.

Parameters per rank follow the tensor-parallel plans of the reference GPT: 1D keeps the
LayerNorms, the row-parallel biases (attention output, MLP output) and the position table
whole on every rank and splits the rest ``tp`` ways (vocabulary, heads, MLP columns); 2D and
3D split every parameter ``tp`` ways; 2.5D splits over the q x q grid and replicates over the
depth (``tp / depth`` ways). The blocks are ``[embed, *layers, head]``, as the pipeline
partitioner cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.comm import TPGrid

__all__ = ["ModelShape", "TPShape"]


@dataclass(frozen=True, slots=True)
class TPShape:
    """How tensor parallelism splits the model: its mode, degree and 2.5D depth."""

    mode: str = "1d"
    tp: int = 1
    depth: int = 1

    @property
    def grid(self) -> TPGrid:
        """The tensor-parallel grid (`tessera.comm.TPGrid`: its side, width split, row blocks)."""
        return TPGrid.of(self.mode, self.tp, self.depth)

    @property
    def ways(self) -> int:
        """How many ways a split parameter is cut (2.5D: replicated over the depth)."""
        return self.tp // self.depth if self.mode == "2.5d" else self.tp


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes of a GPT and the global batch (sequences per optimizer step)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    mlp_ratio: int = 4
    bias: bool = True
    flash_attention: bool = True  # attention keeps no (seq x seq) probabilities for backward
    dropout: bool = False

    @property
    def ffn(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.mlp_ratio * self.hidden

    # ------------------------------------------------------------------ parameters
    def block_params(self, shape: TPShape = TPShape()) -> list[int]:
        """Elements each block of ``[embed, *layers, head]`` holds on one tensor-parallel rank."""
        d, f, v, s, b = self.hidden, self.ffn, self.vocab, self.seq, int(self.bias)
        ways = shape.ways

        def cut(n: int) -> int:
            return -(-n // ways)

        if shape.mode == "1d":
            embed = cut(v * d) + s * d
            split = (
                3 * (d * d + b * d) + d * d + d * f + b * f + f * d
            )  # q, k, v, out_proj.w, fc_in, fc_out.w
            layer = 4 * d + cut(split) + 2 * b * d  # norms and row-parallel biases kept whole
            head = 2 * d + cut(v * d)
        else:
            embed = cut(v * d) + cut(s * d)
            layer = cut(4 * d) + cut(4 * (d * d + b * d)) + cut(d * f + b * f) + cut(f * d + b * d)
            head = cut(2 * d) + cut(v * d)
        return [embed, *([layer] * self.layers), head]

    def unsplit_params(self, shape: TPShape) -> int:
        """Elements tensor parallelism leaves as they were (the same tensors, not copies): in
        1D the position embedding and the LayerNorms; 2D, 2.5D and 3D split every parameter
        (row-parallel biases are copied in every mode)."""
        if shape.tp == 1:
            return self.params
        if shape.mode != "1d":
            return 0
        return self.seq * self.hidden + 4 * self.hidden * self.layers + 2 * self.hidden

    @property
    def params(self) -> int:
        """Parameters of the whole serial model."""
        return sum(self.block_params())

    # ------------------------------------------------------------------ compute
    def layer_flops(self, tokens: float) -> float:
        """Forward FLOPs of one transformer layer over ``tokens`` tokens (matmuls: 2 per
        multiply-add; attention scores and their use over the full sequence)."""
        d, f = self.hidden, self.ffn
        return 2.0 * tokens * (4 * d * d + 2 * d * f) + 4.0 * tokens * self.seq * d

    def head_flops(self, tokens: float) -> float:
        """Forward FLOPs of the LM head over ``tokens`` tokens."""
        return 2.0 * tokens * self.hidden * self.vocab

    def step_flops(self) -> float:
        """Model FLOPs of one optimizer step (forward + backward = 3x forward, no recompute):
        what achieved-FLOP/s figures such as Megatron-LM's count."""
        tokens = self.batch * self.seq
        return 3.0 * (self.layers * self.layer_flops(tokens) + self.head_flops(tokens))
