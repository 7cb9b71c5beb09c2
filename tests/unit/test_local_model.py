"""``tqbatch.workbench.local_model``: a model directory both libraries load by path."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from tqbatch.workbench.local_model import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
    WORDS,
    write_draft_dir,
    write_model_dir,
)

# Everything is local; a stray hub lookup must fail, not download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROMPT = [{"role": "user", "content": "tell me a story about a cat ."}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_model")
    return {
        server: write_model_dir(root / server, server=server) for server in ("mlx-vlm", "mlx-lm")
    }


def test_mlx_vlm_loads_its_directory_as_a_text_only_qwen3(dirs):
    from mlx_vlm.models.qwen3.qwen3 import Model
    from mlx_vlm.utils import load

    model, processor = load(str(dirs["mlx-vlm"]))
    assert isinstance(model, Model)
    # No processor config: AutoProcessor hands back the tokenizer itself.
    assert processor.convert_tokens_to_ids(EOS_TOKEN) == model.config.eos_token_id


def test_mlx_lm_loads_its_directory_with_the_eos_token(dirs):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(dirs["mlx-lm"]))
    assert model.model_type == "qwen3"
    assert tokenizer.eos_token_ids == {SPECIAL_TOKENS.index(EOS_TOKEN)}


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    a = write_model_dir(tmp_path / "a", server="mlx-lm", seed=3, layers=1)
    b = write_model_dir(tmp_path / "b", server="mlx-lm", seed=3, layers=1)
    c = write_model_dir(tmp_path / "c", server="mlx-lm", seed=4, layers=1)
    for name in sorted(p.name for p in a.iterdir()):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_the_tokenizer_round_trips_vocabulary_words(dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(dirs["mlx-lm"]))
    text = "the old cat , the red bird and the big dog go to the river ."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.split())
    assert min(ids) >= len(SPECIAL_TOKENS)  # all known words: no <unk>
    assert tokenizer.decode(ids) == "the old cat, the red bird and the big dog go to the river."
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(WORDS)


def test_the_chat_template_renders_chatml_with_a_generation_prompt(dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(dirs["mlx-lm"]))
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\ntell me a story about a cat .<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_generation_runs_to_max_tokens_without_eos(dirs):
    import mlx_lm
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm.load(str(dirs["mlx-lm"]))
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    assert len(tokens) == 24
    assert all(t >= len(SPECIAL_TOKENS) for t in tokens)  # words only: no EOS, no markers
    assert len(set(tokens)) > 3  # not one token repeated


def test_the_greedy_top_token_stands_clear_of_the_second(dirs):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(dirs["mlx-lm"]))
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    logits = model(mx.array([prompt]))[0, -1]
    top2 = mx.sort(logits)[-2:].tolist()
    assert top2[1] - top2[0] > 1e-3


def test_mlx_vlm_loads_the_draft_directory_as_a_dflash_drafter_of_its_target(dirs, tmp_path):
    from mlx_vlm.speculative.drafters import (
        DFlashDraftModel,
        load_drafter,
        validate_drafter_compatibility,
    )
    from mlx_vlm.utils import load

    draft = write_draft_dir(tmp_path / "draft", dirs["mlx-vlm"])
    drafter, kind = load_drafter(str(draft))
    assert isinstance(drafter, DFlashDraftModel) and kind == "dflash"
    target, _ = load(str(dirs["mlx-vlm"]))
    assert drafter.config.hidden_size == target.language_model.args.hidden_size
    assert drafter.config.target_layer_ids == list(range(len(target.language_model.layers)))
    assert drafter.config.mask_token_id < len(SPECIAL_TOKENS)
    validate_drafter_compatibility(target, drafter, kind)


def test_the_same_seed_writes_the_same_draft_bytes(dirs, tmp_path):
    a = write_draft_dir(tmp_path / "a", dirs["mlx-vlm"], seed=3)
    b = write_draft_dir(tmp_path / "b", dirs["mlx-vlm"], seed=3)
    c = write_draft_dir(tmp_path / "c", dirs["mlx-vlm"], seed=4)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_a_silent_drafter_proposes_its_word_at_every_position(dirs, tmp_path):
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load

    draft = write_draft_dir(tmp_path / "draft", dirs["mlx-vlm"], propose="cool", block_size=4)
    drafter, _ = load_drafter(str(draft))
    target, _ = load(str(dirs["mlx-vlm"]))
    cache = drafter.reset(target)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    hidden = mx.random.normal((2, 5, width), key=mx.random.key(0))
    last = mx.array([SPECIAL_TOKENS.index(EOS_TOKEN) + 10, 20])
    proposed = drafter.draft_block(last, hidden, cache, 4, lambda x: mx.argmax(x, axis=-1))
    word = len(SPECIAL_TOKENS) + WORDS.index("cool")
    assert proposed.tolist() == [[word] * 3] * 2
