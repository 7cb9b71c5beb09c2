"""A tiny random-weight Qwen3 model directory that the real HTTP servers load by path.

``write_model_dir(path, server="mlx-vlm" | "mlx-lm")`` writes config.json,
generation_config.json, model.safetensors (seeded weights: one seed, one set of
bytes) and a word-level tokenizer built locally with ``tokenizers``
(tokenizer.json + tokenizer_config.json with a ChatML template), so that
``python -m mlx_vlm.server --model DIR`` and ``python -m mlx_lm.server --model
DIR`` serve it with nothing downloaded. Both libraries have a text-only
``qwen3`` (mlx-vlm's ``mlx_vlm/models/qwen3`` is a bare language model, no
vision tower; ``AutoProcessor`` on a directory holding only tokenizer files
returns the tokenizer itself), and both read the same HF weight layout
(mlx-vlm's ``sanitize`` prefixes ``language_model.``), so either directory
loads in either library; ``server`` picks whose tiny qwen3 family config
(``vlm_families`` / ``lm_families``) the config starts from.

Greedy decoding must not stop at once: the ``lm_head`` rows of the special
tokens are zero, so their logit is exactly 0 while the top word's is several
std above, and greedy requests never emit EOS: each runs to its
``max_tokens``. ``lm_head`` is scaled so the logits spread with std
``LOGIT_STD`` (top token ~0.8 probable); that widens the top-2 gaps against
float rounding, but not against noise in the hidden state (KV quantization),
which the scale multiplies alike. Measured over 4 prompts x 48 greedy steps
(std 8, seeds 0/1): median top-2 gap 1.6-1.9, 5th percentile 0.13-0.15, and
seed 1 once had a gap below 1e-3, so a greedy token can still flip under
4-bit KV.

Serving it (mlx-vlm 0.7.10, mlx-lm 0.32.2, measured on a 2-core CPU; every
server process with HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1):

* mlx-vlm: ``python -m mlx_vlm.server --model DIR --host 127.0.0.1 --port P
  --max-num-seqs 4 --kv-bits 4 --kv-quant-scheme turboquant
  --quantized-kv-start 0 [--top-logprobs-k K]``. Ready when ``GET /health``
  answers 200 (uvicorn serves only after the model is preloaded; the body has
  ``"loaded_model": DIR``), ~1.5 s. ``POST /v1/chat/completions`` with
  ``{"model": DIR, "messages": [...], "max_tokens": n, "temperature": 0}``;
  temperature defaults to 0 (greedy), max_tokens to 2048 (``--max-tokens``).
  ``"logprobs": true`` gives ``choices[0].logprobs.content`` = [{token,
  logprob, bytes, top_logprobs}], no token ids (this vocabulary maps a token
  string back to its id); ``top_logprobs`` stays [] unless the server runs
  with ``--top-logprobs-k K`` (cap, 0-20). ``seed`` with temperature > 0
  repeats a sample. Every request, streaming or not, goes to one
  continuous-batching thread (``BatchGenerator``); the log shows ``Request
  started: ... in_flight=4`` and the prefills of concurrent requests starting
  in the same millisecond. The ``BatchGenerator`` takes its sampler,
  ``greedy_sampling`` and ``compute_logprobs`` from the request that opened
  it: a request joining a batch opened without ``logprobs`` gets
  ``logprob: 0.0`` for every token. One 16-token request ~0.2 s; 4 concurrent
  64-token requests ~0.8-1.0 s against ~2.3-3.3 s one after another. Stopped
  by SIGINT in ~0.3 s, but the process exits -6 ("terminate called without
  an active exception").
* mlx-lm: ``python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P
  --decode-concurrency 4 --prompt-concurrency 4``, with HF_HUB_CACHE set to an
  existing (even empty) directory: ``GET /v1/models`` scans the hub cache and
  answers 500 with no cache directory. Ready when ``GET /health`` answers
  ``{"status": "ok"}`` (~1 s; it answers before the model is loaded, which
  the first request waits for). Same chat request; temperature defaults to 0
  (``--temp``), max_tokens to 512 (``--max-tokens``). ``"logprobs": true``
  gives ``choices[0].logprobs.content`` = [{id, logprob}];
  ``"top_logprobs": k`` (k <= 10) gives [{id, token, logprob,
  top_logprobs: [{id, token, logprob}]}]. Requests batch only without
  ``seed`` and without ``--kv-bits`` (either makes them run one at a time);
  nothing in the log shows a batch, timings do: 4 concurrent 64-token
  requests ~0.15-0.18 s against ~0.26-0.33 s in a row. Its prompt cache
  reuses shared prefixes (``usage.prompt_tokens_details.cached_tokens``).
  SIGINT stops it in ~0.2 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tqbatch.workbench import lm_families, vlm_families
from tqbatch.workbench.tiny_config import tiny_shape, with_fields

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "LOGIT_STD",
    "PAD_TOKEN",
    "SERVERS",
    "SPECIAL_TOKENS",
    "WORDS",
    "build_tokenizer",
    "model_config",
    "draft_config",
    "mask_token_proposing",
    "write_draft_dir",
    "write_model_dir",
]

SERVERS: tuple[str, ...] = ("mlx-vlm", "mlx-lm")

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN, UNK_TOKEN)

# The vocabulary after the special tokens: fixed, so token ids never move.
WORDS: tuple[str, ...] = tuple(
    """
    . , ? ! : ; ' " ( ) - 0 1 2 3 4 5 6 7 8 9
    a an the this that these those some any every each all no one two three four five
    i you he she it we they me him her us them my your his its our their
    is are was were be been am do does did have has had will would can could shall
    should may might must not and or but if then so because while when where why how
    what who which there here now today tomorrow yesterday always never often again
    system user assistant hello hi please thanks yes ok sure sorry
    time year day week month night morning evening hour minute second moment
    people man woman child friend family teacher student doctor king queen
    world country city town house home room door window table chair bed kitchen
    water fire earth air sun moon star sky sea river lake mountain tree forest flower
    cat dog bird fish horse cow sheep mouse lion bear
    book page word letter story song music picture game ball car road train ship plane
    food bread milk tea coffee apple cake rice egg soup
    red blue green yellow black white orange purple brown gray
    big small long short tall old new young good bad hot cold warm cool fast slow
    happy sad easy hard early late near far high low open closed full empty light dark
    go come run walk see look watch hear listen speak say tell ask answer think know
    make take give get put keep find help try start stop play work read write sing
    eat drink sleep wake live move turn bring carry hold close begin end learn
    in on at to from with without for of by about over under between after before
    up down out into through around very more most less much many few only just also
    """.split()
)
assert len(set(WORDS)) == len(WORDS), "a repeated word would leave a gap in the token ids"

# ChatML, as Qwen's: the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The drafter's mask token: a special token that greedy decoding never emits.
MASK_TOKEN = UNK_TOKEN

# Std of the logits over the vocabulary at a unit-RMS final hidden state.
LOGIT_STD = 8.0


def build_tokenizer():
    """The word-level ``tokenizers.Tokenizer``: special tokens, then ``WORDS``.

    Whitespace pre-tokenization (splits words from punctuation, drops spaces and
    newlines) and a WordPiece decoder, which joins tokens with spaces and glues
    punctuation back on (``"hello , world"`` -> ``"hello, world"``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return tokenizer


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(WORDS)


def model_config(server: str, *, layers: int = 2) -> dict:
    """config.json's fields: ``server``'s tiny qwen3 family config at hidden 64.

    4 query heads over 2 KV heads of head_dim 32, untied ``lm_head`` (scaled
    apart from the embedding), vocab = the tokenizer's.
    """
    if server not in SERVERS:
        raise ValueError(f"server must be one of {SERVERS}, not {server!r}")
    family = (vlm_families if server == "mlx-vlm" else lm_families).CONFIGS["qwen3"]
    tokens = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return with_fields(
        family,
        dict(
            tiny_shape(hidden=64, head_dim=32, vocab=vocab_size()),
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            num_hidden_layers=layers,
            intermediate_size=128,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            torch_dtype="float32",
            eos_token_id=tokens[EOS_TOKEN],
            pad_token_id=tokens[PAD_TOKEN],
            bos_token_id=None,
        ),
    )


def _model_args(config: dict) -> dict:
    """The qwen3 ModelArgs fields of ``config`` (what ``lm_families.build_model`` takes)."""
    keep = {
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "rms_norm_eps",
        "vocab_size",
        "num_key_value_heads",
        "max_position_embeddings",
        "head_dim",
        "tie_word_embeddings",
        "rope_theta",
    }
    return {k: v for k, v in config.items() if k in keep}


def _weights(config: dict, seed: int) -> dict[str, mx.array]:
    """Seeded float32 weights in the HF layout (``model.*``, ``lm_head.weight``)."""
    # lm_families' init (normal(0, 1/fan_in), norms at 1): greedy output that does
    # not collapse onto one repeated token.
    model = lm_families.build_model("qwen3", _model_args(config), seed)
    weights = dict(tree_flatten(model.parameters()))
    # Rows of normal(0, 1/hidden) give logits of std 1 at a unit-RMS hidden state.
    head = weights["lm_head.weight"] * LOGIT_STD
    special = mx.arange(head.shape[0]) < len(SPECIAL_TOKENS)
    weights["lm_head.weight"] = mx.where(special[:, None], 0.0, head)
    return dict(sorted(weights.items()))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_model_dir(path: str | Path, *, server: str, seed: int = 0, layers: int = 2) -> Path:
    """Write a loadable tiny qwen3 model directory for ``server`` at ``path``.

    The same ``seed`` writes byte-identical files. Returns the directory.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(server, layers=layers)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        dict(eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"]),
    )
    mx.save_safetensors(str(out / "model.safetensors"), _weights(config, seed), {"format": "mlx"})
    build_tokenizer().save(str(out / "tokenizer.json"))
    tokens = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    _write_json(
        out / "tokenizer_config.json",
        dict(
            tokenizer_class="PreTrainedTokenizerFast",
            chat_template=CHAT_TEMPLATE,
            eos_token=EOS_TOKEN,
            pad_token=PAD_TOKEN,
            unk_token=UNK_TOKEN,
            bos_token=None,
            model_max_length=4096,
            clean_up_tokenization_spaces=False,
            added_tokens_decoder={
                str(i): dict(
                    content=t,
                    special=True,
                    lstrip=False,
                    rstrip=False,
                    normalized=False,
                    single_word=False,
                )
                for t, i in tokens.items()
            },
        ),
    )
    return out


def draft_config(
    target: dict, *, layers: int = 1, block_size: int = 4, mask_token: str = MASK_TOKEN
) -> dict:
    """config.json's fields of a DFlash drafter (mlx-vlm) for the target config ``target``.

    mlx-vlm names a drafter's architecture ``{model_type}_dflash`` when its
    config has a ``dflash_config`` (``mlx_vlm.utils.get_model_type``): here
    ``qwen3_dflash``, whose ``DFlashDraftModel`` has a Qwen3 backbone of the
    target's hidden size, reads the target's hidden states after every one of
    its layers (``target_layer_ids``) through one ``fc`` and borrows the
    target's embedding and ``lm_head``. ``mask_token_id`` (``mask_token``)
    fills the block's positions after the last accepted token.
    """
    keep = (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "intermediate_size",
        "torch_dtype",
    )
    return dict(
        {k: target[k] for k in keep},
        architectures=["DFlashDraftModel"],
        model_type=target["model_type"],
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        block_size=block_size,
        dflash_config=dict(
            mask_token_id=(SPECIAL_TOKENS + WORDS).index(mask_token),
            target_layer_ids=list(range(target["num_hidden_layers"])),
            num_target_layers=target["num_hidden_layers"],
        ),
    )


def _draft_weights(config: dict, seed: int, *, silent: bool) -> dict[str, mx.array]:
    """Seeded float32 weights of ``config``'s ``DFlashDraftModel`` (its own names).

    ``silent``: every layer's ``o_proj`` and ``down_proj`` zero, so that each
    proposal's hidden state is its input token's embedding.
    """
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    mx.random.seed(seed)
    model = DFlashDraftModel(ModelConfig.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if silent:
        for name, value in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = mx.zeros_like(value)
    return dict(sorted(weights.items()))


def mask_token_proposing(target_dir: str | Path, word: str) -> str:
    """The first token whose embedding the target's final norm and ``lm_head`` read as ``word``.

    A silent drafter (``write_draft_dir(..., propose=word)``) embeds that token
    at every proposal position and reads it out through the target's
    ``lm_head`` (its own final norm at weight 1): it proposes ``word`` each
    time. ValueError if no token does.
    """
    target = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    weights = mx.load(str(Path(target_dir) / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    normed = embed * mx.rsqrt(
        mx.mean(embed * embed, axis=-1, keepdims=True) + target["rms_norm_eps"]
    )
    read = mx.argmax(normed @ head.T, axis=-1).tolist()
    vocab = SPECIAL_TOKENS + WORDS
    wanted = vocab.index(word)
    for token, proposed in enumerate(read):
        if proposed == wanted:
            return vocab[token]
    raise ValueError(f"no token's embedding reads as {word!r} through this target's lm_head")


def write_draft_dir(
    path: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 1,
    layers: int = 1,
    block_size: int = 4,
    propose: str | None = None,
) -> Path:
    """Write a DFlash drafter for the tiny model at ``target_dir`` (mlx-vlm's ``--draft-model``).

    Only mlx-vlm's server takes such a drafter (``--draft-kind dflash``);
    mlx-lm's plain speculative decoding takes a whole model
    (``write_model_dir(..., layers=1)``). Writes config.json (``draft_config``)
    and model.safetensors, the way
    ``mlx_vlm.speculative.drafters.load_drafter`` reads them; the same
    arguments write byte-identical files. Returns the directory.

    Random weights propose tokens the target almost never accepts. With
    ``propose=WORD`` the drafter is silent (``_draft_weights``) and its mask
    token is one that reads as WORD (``mask_token_proposing``): it proposes
    WORD at every position, so a greedy row repeating WORD accepts whole blocks
    while the other rows of its batch accept none.

    mlx-vlm 0.7.10's server loads it against ``write_model_dir``'s target
    (``--draft-model DIR --draft-kind dflash`` logs "Drafter ready; speculative
    decoding enabled.") but cannot serve with it: its text-only qwen3
    ``LanguageModel`` drops the ``capture_layer_ids`` the DFlash rounds pass
    (qwen3_5's honours them), returns no ``hidden_states``, and every request
    fails (HTTP 500, ``TypeError`` from ``mx.concatenate(None)`` in
    ``speculative_hidden_state``) on any cache class.
    """
    target = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    mask = MASK_TOKEN if propose is None else mask_token_proposing(target_dir, propose)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = draft_config(target, layers=layers, block_size=block_size, mask_token=mask)
    _write_json(out / "config.json", config)
    weights = _draft_weights(config, seed, silent=propose is not None)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    return out
