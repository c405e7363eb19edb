"""tessera.models: the models Tessera ships (the reference GPT, and two foreign-shaped models for tests), in plain PyTorch."""

from tessera.models.foreign import GPT2ish, ForeignConfig, Llamaish
from tessera.models.gpt import GPT, GPTConfig, make_batch

__version__ = "0.1.0"

__all__ = ["GPT", "GPT2ish", "ForeignConfig", "GPTConfig", "Llamaish", "make_batch"]
