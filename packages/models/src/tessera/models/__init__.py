"""tessera.models: the models Tessera ships (the reference GPT), in plain PyTorch."""

from tessera.models.gpt import GPT, GPTConfig, make_batch

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "make_batch"]
