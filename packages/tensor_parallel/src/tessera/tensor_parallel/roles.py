"""The role names plans are written in, beyond the 1D styles: ``head``, ``norm``,
``embedding`` and ``replicate``, registered here as their 1D styles.

A plan says what each module *is*; each tensor-parallel mode (``modes``) turns those roles
into its own layers. The 1D style names (``colwise``, ``rowwise``, ``vocab``, ``attention``,
``region``, ...) are roles too. These four name what 1D conflates:

- ``head``: the LM head. In 1D a ``colwise`` layer whose vocab-sharded logits go to the
  vocab-parallel loss; in 2D, 2.5D and 3D the mode's classifier.
- ``norm``: a norm in the residual stream. In 1D what ``sequence_norm`` does (under sequence
  parallelism its parameters' gradients are partial and tagged); in the other modes the
  mode's norm (``nd_styles.NormND``).
- ``embedding``: an embedding whose output is added to the hidden stream (learned
  positions). In 1D kept whole (``sequence_split`` under SP); elsewhere split on the hidden.
- ``replicate``: kept whole everywhere; the user's word that the module sees whole
  activations (its gradient is complete in 1D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tessera.tensor_parallel.layer_styles import Colwise
from tessera.tensor_parallel.style import BaseStyle, register_style
from tessera.tensor_parallel.styles import SequenceNorm, SequenceSplit

__all__ = ["Replicate", "Roles"]


@dataclass(frozen=True, slots=True)
class Replicate(BaseStyle):
    """Keep the module whole on every tp rank. ``grad_complete``: its parameters' gradients
    are the serial ones on every rank (1D: it sees whole activations); False where every
    rank holds a block of each activation (2D, 2.5D, 3D), so they are summed over tp."""

    grad_complete: bool = True


class Roles:
    """The role styles as constants, each registered under its ``name`` (the 1D behaviour)."""

    HEAD: Final = register_style(Colwise("head"))
    NORM: Final = register_style(SequenceNorm("norm"))
    EMBEDDING: Final = register_style(SequenceSplit("embedding"))
    REPLICATE: Final = register_style(Replicate("replicate"))
