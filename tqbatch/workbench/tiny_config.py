"""The tiny config pieces every family of the matrix shrinks its model to.

mlx-lm's and mlx-vlm's families share one attention shape (4 query heads over
2 KV heads, ``tiny_shape``) at different sizes, write each family's config as
the fields it adds to a shared base (``with_fields``) and alternate sliding
and full attention layers the same way (``alternating_layers``).
"""

from __future__ import annotations

__all__ = ["alternating_layers", "tiny_shape", "with_fields"]


def tiny_shape(*, hidden: int, head_dim: int, vocab: int) -> dict:
    """Config fields of a model ``hidden`` wide with 4 query heads over 2 KV heads."""
    return dict(
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=vocab,
    )


def with_fields(base: dict, fields: dict) -> dict:
    """``base`` updated by ``fields``, where a field set to None drops that key of ``base``
    (a config class without it: e.g. one that derives head_dim as hidden / heads)."""
    return {k: v for k, v in {**base, **fields}.items() if v is not None}


def alternating_layers(n_layers: int) -> list[str]:
    """``layer_types`` of ``n_layers`` layers, sliding first: full attention at the odd ones."""
    return ["sliding_attention", "full_attention"] * (n_layers // 2)
