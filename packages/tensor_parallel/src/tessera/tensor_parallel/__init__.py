"""tessera.tensor_parallel: Tensor parallelism: 1D with sequence parallelism, vocab-parallel
embedding and loss, 2D/2.5D/3D layers, ring and Ulysses attention (not built yet; see
issue 3).
"""

__all__: list[str] = []
