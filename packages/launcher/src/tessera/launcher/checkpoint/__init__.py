"""Checkpoints of an engine: generations on disk (``generations``, committed atomically),
saving at once or in the background (``saving``), loading under the same or another topology
(``engine_io``, ``reshard``), folders shared or per node (``storage``), the serial model's full state
gathered back (``consolidate``, ``placement``) and safetensors read one tensor at a time
(``tensorfile``). The format of ZeRO's own sharded state is ``tessera.zero.checkpoint``."""
