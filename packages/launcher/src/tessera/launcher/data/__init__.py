"""The main job's data: the character corpus (``corpus``, ``chars``), the user's own files
(``data_sources``) tokenized once into shards (``prepare``, ``text_tokenizers``) and read back as
deterministic, resumable batches (``token_data``). Torch-free except ``chars`` and ``token_data``."""
