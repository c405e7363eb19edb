"""Tier 0: ``head_layout`` reads an attention module's heads from its attributes, its config
and its projections' widths, and refuses widths that disagree, naming them; a latent
attention's query heads (DeepSeek's ``qk_head_dim``) are wider than the ``head_dim`` its config
names, and are checked at their own width."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from tessera.tensor_parallel.heads import head_layout


def _attention(q_out: int, k_out: int | None, **attrs: int) -> nn.Module:
    module = nn.Module()
    module.q_proj = nn.Linear(16, q_out, bias=False)
    if k_out is not None:
        module.k_proj = nn.Linear(16, k_out, bias=False)
    module.config = SimpleNamespace(num_attention_heads=4, head_dim=4)
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def test_the_heads_come_from_the_config_and_the_widths_agree() -> None:
    layout = head_layout(_attention(16, 8, num_key_value_heads=2))
    assert layout is not None and (layout.heads, layout.kv_heads, layout.head_dim) == (4, 2, 4)


def test_a_width_that_disagrees_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"q_proj has 32 output features, not 4 heads x head_dim 4"):
        head_layout(_attention(32, None))
    with pytest.raises(ValueError, match=r"k_proj has 12 output features, not 2 heads x head_dim 4"):
        head_layout(_attention(16, 12, num_key_value_heads=2))


def test_a_latent_attentions_query_heads_are_checked_at_their_own_width() -> None:
    layout = head_layout(_attention(32, None, qk_head_dim=8))  # 4 heads x (4 plain + 4 rotary)
    assert layout is not None and layout.heads == 4
    with pytest.raises(ValueError, match=r"q_proj has 24 output features, not 4 heads x head_dim 8"):
        head_layout(_attention(24, None, qk_head_dim=8))
