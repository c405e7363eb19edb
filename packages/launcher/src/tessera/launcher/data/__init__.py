"""The main job's data: the character corpus (``corpus``, ``chars``), the user's own files
(``data_sources``) tokenized once into shards (``prepare``, ``text_tokenizers``) and read back as
deterministic, resumable batches (``token_data``); fine-tuning examples from a jsonl file
(``finetune_examples``) in rows with the loss on the responses (``finetune``). Torch-free except
``chars``, ``token_data`` and ``finetune``."""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports

if TYPE_CHECKING:
    from tessera.launcher.data.finetune import FinetuneData, finetune_data
    from tessera.launcher.data.finetune_examples import load_tokenizer, read_examples
    from tessera.launcher.data.token_data import Data, TokenData, open_data

__all__ = [
    "Data",
    "FinetuneData",
    "TokenData",
    "finetune_data",
    "load_tokenizer",
    "open_data",
    "read_examples",
]

if not TYPE_CHECKING:  # imported on first use (PEP 562), so the package stays light to import
    __getattr__, __dir__ = lazy_exports(__name__, ("token_data", "finetune_examples", "finetune"))
