"""``[finetune]``: LoRA fine-tuning of a pretrained Hugging Face model (``tessera finetune``).

``model``: a checkpoint folder as ``save_pretrained`` writes it (``config.json``, the weights as
``model.safetensors`` or shards with their index, the tokenizer's files). ``data``: a ``.jsonl``
file of prompt/response pairs or chats (``tessera.launcher.data.finetune_examples``; the field
names are ``prompt_field``, ``response_field``, ``messages_field``). Each example becomes a row
of ``seq_len`` tokens (``packing``: several per row), the loss only on the responses. The
adapters: PEFT's ``LoraConfig`` with rank ``rank``, ``alpha``, ``dropout`` on ``targets`` (module
names, comma-separated, or ``all-linear``: every linear layer but the output head);
``modules_to_save`` (comma-separated module names, e.g. ``lm_head``) trains those layers whole,
as PEFT's option of that name does (a trained copy beside the frozen original). The global
batch, steps, learning rate and the degrees are the usual ``[data]``, ``[train]``, ``[optim]``
and ``[parallel]`` settings.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FinetuneConfig", "finetune_problems"]


@dataclass(frozen=True, slots=True)
class FinetuneConfig:
    """See the module docstring."""

    model: str = ""
    data: str = ""
    seq_len: int = 256
    packing: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "all-linear"
    modules_to_save: str = ""
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"

    def target_modules(self) -> str | list[str]:
        """``targets`` as PEFT takes them: ``"all-linear"``, or the list of names."""
        names = [t.strip() for t in self.targets.split(",") if t.strip()]
        return "all-linear" if names == ["all-linear"] else names

    def saved_whole(self) -> list[str] | None:
        """``modules_to_save`` as PEFT takes it (None: none)."""
        names = [t.strip() for t in self.modules_to_save.split(",") if t.strip()]
        return names or None


def finetune_problems(f: FinetuneConfig) -> list[str]:
    """What is wrong with ``[finetune]`` for ``tessera finetune``, one line each, read from the
    files' names and headers only (nothing is loaded), and whether ``transformers`` and ``peft``
    are installed (found, not imported)."""
    errors = [
        f"tessera finetune needs the {name} package: pip install {name}"
        for name in ("transformers", "peft")
        if importlib.util.find_spec(name) is None
    ]
    folder = Path(f.model)
    if not f.model:
        errors.append("finetune.model: give the pretrained model's folder (config.json and its weights)")
    elif not (folder / "config.json").is_file():
        errors.append(f"finetune.model={f.model}: no config.json there (a folder save_pretrained wrote)")
    else:
        weights = [folder / "model.safetensors", folder / "model.safetensors.index.json"]
        if not any(w.is_file() for w in weights):
            errors.append(
                f"finetune.model={f.model}: no model.safetensors nor model.safetensors.index.json there"
            )
        try:
            json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            errors.append(f"finetune.model={f.model}: config.json is not readable JSON ({exc})")
    if not f.data:
        errors.append("finetune.data: give a .jsonl file of prompt/response pairs or chats")
    elif not Path(f.data).is_file() or Path(f.data).suffix != ".jsonl":
        errors.append(f"finetune.data={f.data}: not a .jsonl file")
    if f.seq_len < 2:
        errors.append(f"finetune.seq_len must be >= 2, got {f.seq_len}")
    if not 0.0 <= f.dropout < 1.0:
        errors.append(f"finetune.dropout must be in [0, 1), got {f.dropout}")
    if not f.alpha > 0:
        errors.append(f"finetune.alpha must be > 0, got {f.alpha}")
    if not f.target_modules():
        errors.append("finetune.targets: name at least one module (or all-linear)")
    return errors
