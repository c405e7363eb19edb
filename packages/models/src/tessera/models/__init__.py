"""tessera.models: the models Tessera ships, in plain PyTorch: the reference GPT, and two
models shaped the way users write theirs (``foreign``, with the plans of roles a user writes for
them) and a user's own LoRA layer (``low_rank``), for tests."""

from tessera.models.foreign import GPT2ISH_ROLES, LLAMAISH_ROLES, ForeignConfig, GPT2ish, Llamaish
from tessera.models.gpt import GPT, GPTConfig, make_batch
from tessera.models.low_rank import LowRank, with_low_rank

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPT2ISH_ROLES",
    "LLAMAISH_ROLES",
    "ForeignConfig",
    "GPT2ish",
    "GPTConfig",
    "Llamaish",
    "LowRank",
    "make_batch",
    "with_low_rank",
]
