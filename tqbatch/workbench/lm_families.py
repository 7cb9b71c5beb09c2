"""Tiny random-weight models of mlx-lm's own model code, for the model-family matrix.

Each family is ``mlx_lm.models.<name>.Model`` of mlx-lm 0.32.2, shrunk to 2
layers of hidden size 64, head_dim 32, at most 4 query / 2 KV heads and a
256-token vocabulary, in float32 with seeded weights (nothing downloaded).
Matrix names carry the prefix ``mlx-lm:`` (``mlx-lm:llama``), so that they
never read as the mlx-vlm families of ``tqbatch.workbench.vlm_families``.

Caches follow mlx-lm's rule, not mlx-vlm's: a request's caches are
``tqbatch.mlx_lm.make_prompt_cache`` (the model's own caches, each plain
``KVCache`` TurboQuant; the last layer too, unlike mlx-vlm) for a quantized
target, mlx-lm's ``make_prompt_cache`` for full precision. A left-padded batch
holds, per layer, the batch class of that layer's single cache, as mlx-lm's
batch generators have built it (``KVCache`` -> ``BatchKVCache``,
``RotatingKVCache`` -> ``BatchRotatingKVCache``, TurboQuant -> the target).
The model runs under ``tqbatch.mlx_lm.routed()``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import cache as lm_cache
from mlx_vlm.turboquant import TurboQuantKVCache

from tqbatch import mlx_lm as tq_mlx_lm
from tqbatch.cache import BatchableTurboQuantKVCache
from tqbatch.workbench.family import Family
from tqbatch.workbench.tiny_config import alternating_layers, tiny_shape, with_fields

__all__ = [
    "CONFIGS",
    "FAMILIES",
    "PREFIX",
    "SPECS",
    "LmFamily",
    "build_model",
]

PREFIX = "mlx-lm:"

_COMMON = dict(
    tiny_shape(hidden=64, head_dim=32, vocab=256), num_hidden_layers=2, rms_norm_eps=1e-6
)
_SLIDING_WINDOW = 4  # shorter than the prompts, so the rotating layers' window bites
# mlx-lm family -> ModelArgs fields beyond _COMMON; None drops a _COMMON field the
# family's ModelArgs does not have (it derives head_dim as hidden / heads).
CONFIGS: dict[str, dict] = {
    "llama": dict(intermediate_size=128, tie_word_embeddings=False),
    "qwen2": dict(
        intermediate_size=128,
        num_attention_heads=2,  # no head_dim field: 64 / 2 = 32
        num_key_value_heads=1,
        head_dim=None,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    "qwen3_moe": dict(
        intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        norm_topk_prob=True,
    ),
    "gemma3_text": dict(  # layer 0 sliding (RotatingKVCache), layer 1 global (KVCache)
        intermediate_size=128,
        query_pre_attn_scalar=32,
        sliding_window=_SLIDING_WINDOW,
        sliding_window_pattern=2,
    ),
    "phi3": dict(  # fused qkv projection; no head_dim field: 64 / 2 = 32
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=None,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "gpt_oss": dict(  # attention sinks, sliding and full layers, mixture of experts
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=_SLIDING_WINDOW,
        layer_types=alternating_layers(2),
    ),
}

# mlx-lm models take no capture_layer_ids: there is no hidden-state capture to verify.
_NO_CAPTURE = (
    "speculative_capture",
    "mlx-lm's models take no capture_layer_ids (mlx-vlm's DFlash/EAGLE hook)",
)


@dataclass(frozen=True)
class LmFamily(Family):
    """An mlx-lm model class under mlx-lm's cache rule, run under ``tqbatch.mlx_lm.routed()``.

    ``name`` is PREFIX + the mlx-lm module's name, which is also ``module``: the
    model calls that module's scaled_dot_product_attention.
    """

    not_applicable: tuple[tuple[str, str], ...] = (_NO_CAPTURE,)

    library: ClassVar[str] = "mlx-lm"
    # mlx-lm's own serving loop, for mlx-lm's own model classes only.
    own_scenarios: ClassVar[tuple[str, ...]] = ("batch_generator",)

    def build(self, seed: int = 0) -> nn.Module:
        """The model with seeded random float32 weights (see ``build_model``)."""
        return _build(self.name.removeprefix(PREFIX), self.config, seed)

    def quantized_layers(self, model: nn.Module) -> list[int]:
        """Layers mlx-lm's rule (``tqbatch.mlx_lm.make_prompt_cache``) puts on TurboQuant."""
        caches = tq_mlx_lm.make_prompt_cache(model)
        return [i for i, c in enumerate(caches) if isinstance(c, BatchableTurboQuantKVCache)]

    def alone_caches(self, model: nn.Module, layers, quantized: bool, bits: float, seed: int):
        """One request's caches: mlx-lm's, a ``TurboQuantKVCache`` on ``layers`` if quantized."""
        caches = lm_cache.make_prompt_cache(model)
        if quantized:
            for i in layers:
                caches[i] = TurboQuantKVCache(bits=bits, seed=seed)
        return caches

    def batch_caches(self, model: nn.Module, left_padding, target_cls, bits: float, seed: int):
        """A left-padded batch's caches: each layer's single cache's batch class.

        ``target_cls`` None: full precision (mlx-lm's own caches throughout).
        """
        padding = list(left_padding)
        singles = (
            lm_cache.make_prompt_cache(model)
            if target_cls is None
            else tq_mlx_lm.make_prompt_cache(model, bits=bits, seed=seed, batch_class=target_cls)
        )
        out = []
        for c in singles:
            if isinstance(c, BatchableTurboQuantKVCache):
                out.append(target_cls(padding, bits=bits, seed=seed))
            elif type(c) is lm_cache.KVCache:
                out.append(lm_cache.BatchKVCache(padding))
            elif type(c) is lm_cache.RotatingKVCache:
                out.append(lm_cache.BatchRotatingKVCache(c.max_size, padding))
            elif type(c) is lm_cache.ArraysCache:
                out.append(lm_cache.ArraysCache(len(c.cache), left_padding=padding))
            else:
                raise TypeError(f"no batch class for mlx-lm's {type(c).__name__}")
        return out

    def routed(self):
        """mlx-lm's attention hands TurboQuant caches to mlx-vlm's only under the route."""
        return tq_mlx_lm.routed()


_NOTES = {
    "llama": "KVCache per layer; one mask from cache[0]",
    "qwen2": "KVCache per layer; q/k/v biases",
    "qwen3": "KVCache per layer; q/k RMSNorm before RoPE",
    "qwen3_moe": "KVCache per layer; mixture-of-experts MLP",
    "gemma3_text": "make_cache: RotatingKVCache on sliding layers (kept), KVCache on global ones",
    "phi3": "KVCache per layer; fused qkv projection",
    "gpt_oss": "make_cache: RotatingKVCache on sliding layers (kept); attention sinks",
}
SPECS: dict[str, LmFamily] = {
    PREFIX + name: LmFamily(
        PREFIX + name, f"mlx_lm.models.{name}", _NOTES[name], with_fields(_COMMON, fields)
    )
    for name, fields in CONFIGS.items()
}
FAMILIES: tuple[str, ...] = tuple(SPECS)


def build_model(name: str, fields: dict, seed: int = 0) -> nn.Module:
    """The tiny model of any mlx-lm model module ``name``: the shape these families
    share, with ``fields`` (ModelArgs fields; None drops a shared one).

    Weights normal(0, 1/fan_in), biases normal(0, 0.1), norms as made (as
    ``tqbatch.workbench.e2e.build_model``): greedy output that does not
    collapse onto one repeated token.
    """
    return _build(name, with_fields(_COMMON, fields), seed)


def _build(name: str, params: dict, seed: int) -> nn.Module:
    """mlx-lm module ``name``'s ``Model`` of ModelArgs ``params``, weights seeded."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    model = module.Model(module.ModelArgs(model_type=name, **params))
    weights = []
    for i, (key_name, param) in enumerate(sorted(tree_flatten(model.parameters()))):
        key = mx.random.key(seed * 1_000_003 + i)
        if "norm" in key_name:
            weights.append((key_name, param))
        elif "embed_tokens" in key_name:
            weights.append((key_name, mx.random.normal(param.shape, key=key) * 64**-0.5))
        elif key_name.endswith("bias") or param.ndim == 1:
            weights.append((key_name, mx.random.normal(param.shape, key=key) * 0.1))
        else:
            scale = param.shape[-1] ** -0.5
            weights.append((key_name, mx.random.normal(param.shape, key=key) * scale))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model
