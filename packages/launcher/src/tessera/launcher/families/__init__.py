"""What ``boost()`` knows about a model: the model contract (`ModelSpec`, ``spec``), the models
and Hugging Face families registered by name (``known``), a plan of roles read from any module
tree (``derived_roles``), Hugging Face pipeline blocks (``hf``) and MoE conversion (``hf_moe``)."""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports

if TYPE_CHECKING:
    from tessera.launcher.families.known import REFERENCE_GPT_SPEC
    from tessera.launcher.families.spec import (
        ModelSpec,
        model_spec,
        register_model_family,
        register_model_spec,
    )

__all__ = ["REFERENCE_GPT_SPEC", "ModelSpec", "model_spec", "register_model_family", "register_model_spec"]

if not TYPE_CHECKING:  # imported on first use (PEP 562), so the package stays light to import
    __getattr__, __dir__ = lazy_exports(__name__, ("known", "spec"))
