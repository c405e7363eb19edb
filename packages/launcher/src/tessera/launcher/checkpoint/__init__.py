"""Checkpoints of an engine: generations on disk (``generations``, committed atomically),
saving at once or in the background (``saving``), loading under the same or another topology
(``engine_io``, ``reshard``), folders shared or per node (``storage``), the serial model's full state
gathered back (``consolidate``, ``placement``) and safetensors read one tensor at a time
(``tensorfile``). The format of ZeRO's own sharded state is ``tessera.zero.checkpoint``."""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports

if TYPE_CHECKING:
    from tessera.launcher.checkpoint.generations import committed_checkpoint, generation_name, saved_vocab

__all__ = ["committed_checkpoint", "generation_name", "saved_vocab"]

if not TYPE_CHECKING:  # imported on first use (PEP 562), so the package stays light to import
    __getattr__, __dir__ = lazy_exports(__name__, ("generations",))
