"""The main job's data: the character corpus (``corpus``, ``chars``), the user's own files
(``data_sources``) tokenized once into shards (``prepare``, ``text_tokenizers``) and read back as
deterministic, resumable batches (``token_data``). Torch-free except ``chars`` and ``token_data``."""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports

if TYPE_CHECKING:
    from tessera.launcher.data.token_data import Data, TokenData, open_data

__all__ = ["Data", "TokenData", "open_data"]

if not TYPE_CHECKING:  # imported on first use (PEP 562), so the package stays light to import
    __getattr__, __dir__ = lazy_exports(__name__, ("token_data",))
