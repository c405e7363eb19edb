"""tessera.models: the models Tessera ships, in plain PyTorch: the reference GPT, and two
models shaped the way users write theirs (``foreign``) for tests."""

from tessera.models.foreign import ForeignConfig, GPT2ish, Llamaish
from tessera.models.gpt import GPT, GPTConfig, make_batch

__version__ = "0.1.0"

__all__ = ["GPT", "ForeignConfig", "GPT2ish", "GPTConfig", "Llamaish", "make_batch"]
