"""Tiny random-weight language models built from mlx-vlm's own model code.

For testing a batch KV cache as a drop-in inside each family's real attention
code: every model here is the family's own ``LanguageModel`` class from mlx-vlm
0.7.10 (no vision/audio towers), shrunk to a few layers of hidden size 128,
head_dim 64, at most 4 query / 2 KV heads, 128-wide MLPs and a 512-token
vocabulary, in float32 and seeded so that ``SPECS[name].build(seed)`` is
reproducible. Each family has enough layers that mlx-vlm's quantization rule
(``mlx_vlm.models.cache.should_quantize_kv_layer``: the last cache layer stays
full precision when there are more than two; rotating sliding-window caches and
linear-attention ``ArraysCache`` layers are never quantized) leaves at least two
full-attention layers on a quantized cache; see ``VlmFamily.quantized_layers``.

The caches come from mlx-vlm itself: ``make_single_cache`` is what it makes for
one request and ``make_batch_cache`` is exactly ``mlx_vlm.generate.ar._make_cache``
with ``kv_quant_scheme="turboquant"``. ``VlmFamily.module`` names the module whose
global ``scaled_dot_product_attention`` the family's attention layers call, the
place to patch to route attention elsewhere.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from tqbatch.workbench.family import Family
from tqbatch.workbench.tiny_config import alternating_layers, tiny_shape, with_fields

__all__ = [
    "CONFIGS",
    "FAMILIES",
    "SPECS",
    "VlmFamily",
    "call_kwargs",
    "forward",
    "logits_of",
    "make_batch_cache",
    "make_single_cache",
    "vocab_size",
]

FAMILIES: tuple[str, ...] = (
    "qwen2",
    "qwen3",
    "llama",
    "gemma3_text",
    "gemma4_text",
    "qwen3_5",
    "lfm2",
    "gpt_oss",
    "gemma4",
)

_SLIDING_WINDOW = 8  # small, so it bites in ~30-token runs
_ALTERNATING = alternating_layers(6)  # full at 1, 3, 5

# What every family's config holds unless its fields below say otherwise: head_dim
# 64 throughout (families without a head_dim field derive it as hidden_size //
# num_attention_heads, hence 2 query heads there), MLPs 128 wide: on a CPU most of
# a forward's time is the matmuls.
_SHAPE = dict(tiny_shape(hidden=128, head_dim=64, vocab=512), intermediate_size=128)

# mlx-vlm family -> its config class's fields beyond _SHAPE; None drops a _SHAPE
# field the class does not have. gemma4's (the Gemma 4 VLM's text_config) are
# gemma4_text's: added below.
CONFIGS: dict[str, dict] = {
    "qwen2": dict(
        model_type="qwen2",
        num_hidden_layers=3,  # layers 0, 1 quantized; the last stays full precision
        num_attention_heads=2,  # no head_dim field: 128 // 2 = 64
        num_key_value_heads=1,
        head_dim=None,
        rms_norm_eps=1e-6,
    ),
    "qwen3": dict(
        model_type="qwen3",
        num_hidden_layers=3,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "llama": dict(
        model_type="llama",
        num_hidden_layers=3,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_hidden_layers=6,
        query_pre_attn_scalar=64,  # scale = head_dim ** -0.5
        sliding_window=_SLIDING_WINDOW,
        sliding_window_pattern=2,  # layer i is global iff i % 2 == 1: globals 1, 3, 5
    ),
    "gemma4_text": dict(
        model_type="gemma4_text",
        num_hidden_layers=6,
        global_head_dim=64,  # full-attention layers would otherwise use 512
        vocab_size_per_layer_input=512,
        num_kv_shared_layers=0,  # every layer owns its cache
        hidden_size_per_layer_input=0,  # per-layer input embeddings disabled
        sliding_window=_SLIDING_WINDOW,
        sliding_window_pattern=2,
        layer_types=_ALTERNATING,
    ),
    "qwen3_5": dict(  # the text_config of a qwen3_5 ModelConfig (vision config left default)
        model_type="qwen3_5_text",
        num_hidden_layers=6,
        full_attention_interval=2,  # layer i is full attention iff (i + 1) % 2 == 0: 1, 3, 5
        # Gated-delta layers hold no KV cache; 32-wide heads keep their CPU fallback
        # (a per-token loop) cheap. 2 value heads share 1 key head, as in real Qwen3.5.
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        # partial RoPE on 64 * 0.25 = 16 dims = 8 frequencies, split 3/3/2 over (t, h, w)
        rope_parameters={
            "type": "default",
            "mrope_section": [3, 3, 2],
            "rope_theta": 100000,
            "partial_rotary_factor": 0.25,
        },
    ),
    "lfm2": dict(
        model_type="lfm2",
        num_hidden_layers=6,
        full_attn_idxs=[1, 3, 5],  # conv layers 0, 2, 4
        intermediate_size=None,  # the MLP is block_ff_dim wide
        num_attention_heads=2,  # no head_dim field: 128 // 2 = 64
        num_key_value_heads=1,
        head_dim=None,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=128,
        block_ff_dim=128,
        block_multiple_of=128,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,  # keep the MLP at exactly block_ff_dim
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_hidden_layers=6,
        num_local_experts=4,  # gpt_oss's MLP is always MoE
        num_experts_per_tok=2,
        intermediate_size=64,  # per expert: 2 active experts make 128, as the dense MLPs
        sliding_window=_SLIDING_WINDOW,
        layer_types=_ALTERNATING,
    ),
}
CONFIGS["gemma4"] = CONFIGS["gemma4_text"]  # gemma4.config.TextConfig


@dataclass(frozen=True)
class VlmFamily(Family):
    """An mlx-vlm family's ``LanguageModel`` under mlx-vlm's cache rule."""

    library: ClassVar[str] = "mlx-vlm"

    def build(self, seed: int = 0) -> nn.Module:
        mx.random.seed(seed)
        model = _construct(self.name, self.config)
        model.eval()
        mx.eval(model.parameters())
        return model

    def quantized_layers(self, model: nn.Module) -> list[int]:
        """Layers that get mlx-vlm's ``BatchTurboQuantKVCache`` at 4 bits."""
        from mlx_vlm.turboquant import BatchTurboQuantKVCache

        caches = make_batch_cache(model, [0], 4.0)
        return [i for i, c in enumerate(caches) if isinstance(c, BatchTurboQuantKVCache)]

    def alone_caches(self, model: nn.Module, layers, quantized: bool, bits: float, seed: int):
        from mlx_vlm.turboquant import TurboQuantKVCache

        caches = make_single_cache(model)
        if quantized:
            for i in layers:
                caches[i] = TurboQuantKVCache(bits=bits, seed=seed)
        return caches

    def batch_caches(self, model: nn.Module, left_padding, target_cls, bits: float, seed: int):
        """mlx-vlm's batch caches, ``target_cls`` where it puts ``BatchTurboQuantKVCache``."""
        from mlx_vlm.turboquant import BatchTurboQuantKVCache

        if target_cls is None:
            return make_batch_cache(model, list(left_padding), kv_bits=None)
        caches = make_batch_cache(model, list(left_padding), kv_bits=bits)
        return [
            target_cls(list(left_padding), bits=bits, seed=seed)
            if isinstance(c, BatchTurboQuantKVCache)
            else c
            for c in caches
        ]


def _family(name: str, module: str, notes: str, **kwargs) -> VlmFamily:
    return VlmFamily(name, module, notes, with_fields(_SHAPE, CONFIGS[name]), **kwargs)


SPECS: dict[str, VlmFamily] = {
    f.name: f
    for f in (
        _family(
            "qwen2",
            "mlx_vlm.models.qwen2.language",
            "no make_cache: one KVCache per layer; RoPE at cache.offset (a per-row array in a "
            "batch); one mask for all layers from cache[0].make_mask",
        ),
        _family(
            "qwen3",
            "mlx_vlm.models.qwen3.language",
            "no make_cache: one KVCache per layer; q/k RMSNorm before RoPE at cache.offset; "
            "one mask for all layers from cache[0].make_mask",
        ),
        _family(
            "llama",
            "mlx_vlm.models.llama.language",
            "make_cache: KVCache per full_attention layer (RotatingKVCache only for "
            "sliding layer_types, none here); mask from cache[fa_idx]",
        ),
        _family(
            "gemma3_text",
            "mlx_vlm.models.gemma3.language",
            "gemma3's LanguageModel; sliding layers get RotatingKVCache -> "
            "BatchRotatingKVCache (never quantized); global mask from "
            "cache[sliding_window_pattern-1], sliding mask from cache[0]; array masks "
            "sliced to kv_sequence_length(keys)",
        ),
        _family(
            "gemma4_text",
            "mlx_vlm.models.gemma4_text.language",
            "sliding layers get RotatingKVCache; RoPE offset mx.array(cache.offset); one "
            "mask per layer type from that type's first cache; KV sharing off "
            "(num_kv_shared_layers=0: make_cache covers every layer)",
        ),
        _family(
            "qwen3_5",
            "mlx_vlm.models.qwen3_5.language",
            "ArraysCache(size=2) on gated-delta layers (gets .left_padding), KVCache on full "
            "layers; a left-padded batch whose full-attention cache class has extract+merge "
            "(BatchKVCache; not BatchTurboQuantKVCache) runs each row alone and replaces the "
            "list entries with cls.merge(rows); padded decode drops the mask for a "
            "'left_padded_decode' path that caches with .bits skip (SDPA gets mask=None); "
            "reads offset/left_padding/_idx/_offset/lengths, sets _qwen3_5_* attributes on "
            "caches",
            prefills_rows_in_full_precision=True,
        ),
        _family(
            "lfm2",
            "mlx_vlm.models.lfm2.language",
            "ArraysCache(size=1) conv state on conv layers (mask from its left_padding), "
            "KVCache on attention layers (mask from cache[full_attn_idxs[0]]); speculative "
            "rollback trims, then on ragged accepts calls prepare(right_padding=)/finalize() "
            "or zeroes dense keys/values tails past _idx",
        ),
        _family(
            "gpt_oss",
            "mlx_vlm.models.gpt_oss.language",
            "sliding layers get RotatingKVCache; every attention call passes sinks "
            "(zero-init per-head logits), which rules out TurboQuant's fused kernels "
            "(dequantize + mx.fast SDPA with sinks); masks from cache[ga_idx]/cache[swa_idx]",
        ),
        _family(
            "gemma4",
            "mlx_vlm.models.gemma4.language",
            "Gemma 4 VLM's text model: as gemma4_text, but the full-attention mask is an "
            "array whenever the cache has left_padding and the sliding mask whenever "
            "max(offset) > 0; rollback_speculative_cache trims and raises on ragged "
            "accepts for caches with _idx and keys",
            not_applicable=tuple(
                (
                    scenario,
                    "mlx-vlm's Gemma 4 rollback requires uniform acceptance (it raises on "
                    "ragged accepts; servers clamp them: requires_uniform_batch_acceptance)",
                )
                for scenario in ("speculative", "speculative_capture")
            ),
        ),
    )
}


def _config(cls, params: dict):
    """``cls.from_dict(params)``, refusing keys it would silently drop."""
    unknown = sorted(set(params) - set(inspect.signature(cls).parameters))
    if unknown:
        raise ValueError(f"{cls.__module__}.{cls.__name__} has no fields {unknown}")
    return cls.from_dict(dict(params))


def _construct(name: str, params: dict) -> nn.Module:
    if name == "gemma3_text":  # gemma3_text's ModelConfig, gemma3's LanguageModel
        from mlx_vlm.models.gemma3.language import LanguageModel
        from mlx_vlm.models.gemma3_text.config import ModelConfig

        return LanguageModel(_config(ModelConfig, params))
    if name == "gemma4":  # as gemma4.Model builds it: LanguageModel(config.text_config)
        from mlx_vlm.models.gemma4.config import TextConfig
        from mlx_vlm.models.gemma4.language import LanguageModel

        return LanguageModel(_config(TextConfig, params))
    if name == "qwen3_5":  # as qwen3_5.Model builds it: LanguageModel(text_config, config)
        from mlx_vlm.models.qwen3_5.config import ModelConfig, TextConfig, VisionConfig
        from mlx_vlm.models.qwen3_5.language import LanguageModel

        text = _config(TextConfig, params)
        # get_rope_index reads image/video token ids and the vision spatial_merge_size
        # from the full config; the vision config is never built into weights.
        config = ModelConfig(text_config=text, vision_config=VisionConfig(), model_type=name)
        return LanguageModel(text, config)
    config_cls = importlib.import_module(f"mlx_vlm.models.{name}.config").ModelConfig
    language = importlib.import_module(f"mlx_vlm.models.{name}.language")
    return language.LanguageModel(_config(config_cls, params))


def forward(model: nn.Module, tokens: mx.array, cache: list) -> mx.array:
    """(B, T) int32 tokens -> (B, T, vocab) float32 logits, updating ``cache``.

    Called as mlx-vlm's generators call a language model on a text-only request,
    ``language_model(inputs, cache=cache, **kwargs)``, logits read from ``.logits``.
    The one kwarg is for mRoPE families (qwen3_5), whose positions the generators
    pass in as prompt kwargs (``position_ids`` at prefill, left padding at 0, then
    ``rope_deltas``): here every call passes ``position_ids`` putting row ``b``'s
    column ``j`` at ``max(offset[b] + j, 0)``. Called bare, qwen3_5 ropes a
    left-padded prompt row from its padded column index but decodes from
    ``cache.offset`` (so batch rows stop matching single requests even at full
    precision), and it keeps ``_position_ids`` / ``_rope_deltas`` on the model
    between calls.
    """
    return logits_of(model(tokens, cache=cache, **call_kwargs(model, tokens, cache)))


def call_kwargs(model: nn.Module, tokens: mx.array, cache: list) -> dict:
    """The keyword arguments ``forward`` passes besides ``cache`` (see there)."""
    if hasattr(model, "get_rope_index"):
        return {"position_ids": _text_positions(model, tokens, cache)}
    return {}


def logits_of(output) -> mx.array:
    """Float32 logits of a language model's output (``LanguageModelOutput`` or an array)."""
    logits = output.logits if hasattr(output, "logits") else output
    return logits.astype(mx.float32)


def vocab_size(model: nn.Module) -> int:
    return int(model.args.vocab_size) if hasattr(model, "args") else int(model.config.vocab_size)


def _text_positions(model: nn.Module, tokens: mx.array, cache: list) -> mx.array:
    """(B, T) text positions from the full-attention cache's offset(s)."""
    B, T = tokens.shape
    offset = cache[model.model.fa_idx].offset
    steps = mx.arange(T, dtype=mx.int32)[None, :]
    if isinstance(offset, mx.array) and offset.ndim > 0:
        return mx.maximum(offset[:B, None].astype(mx.int32) + steps, 0)
    return mx.broadcast_to(int(offset) + steps, (B, T))


def make_single_cache(model: nn.Module) -> list:
    """Per-layer caches as mlx-vlm makes them for one request."""
    from mlx_vlm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def make_batch_cache(
    model: nn.Module, left_padding: list[int], kv_bits: float | None = 4.0
) -> list:
    """``mlx_vlm.generate.ar._make_cache`` with the TurboQuant scheme.

    ``kv_bits=None`` gives mlx-vlm's full-precision batch caches.
    """
    from mlx_vlm.generate.ar import _make_cache

    return _make_cache(model, list(left_padding), kv_bits=kv_bits, kv_quant_scheme="turboquant")
