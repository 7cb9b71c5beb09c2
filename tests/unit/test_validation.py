"""What enters from outside is checked first: constructor arguments, update inputs, ``state``,
``meta_state`` and saved files.

Each case asserts the typed error and its message, that the cache still
equals its snapshot (``assert_rejected``: geometry, packed buffers, codecs,
pending padding, meta_state) and that it still works afterwards. The
companion ``test_bad_input.py`` covers the ops' own arguments (filter,
extract, trim, merge, extend, prepare) and shape mismatches.
"""

# The case tables keep one case per line, past the line length.
# ruff: noqa: E501

from __future__ import annotations

import json
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.turboquant import TurboQuantMSEState

import tqbatch
from tqbatch import load_batch_cache, save_batch_cache

from .support import Impl, Lockstep, assert_rejected, normal, observe, then_still_in_lockstep

# ---------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (dict(bits=16), ValueError, r"bits=16.*1 to 8"),
        (dict(bits=9), ValueError, r"bits=9"),
        (dict(bits=0.5), ValueError, r"bits=0\.5"),
        (dict(bits=4.3), ValueError, r"bits=4\.3.*0\.5"),
        (dict(bits=float("inf")), ValueError, r"bits must be finite"),
        (dict(bits=float("nan")), ValueError, r"bits must be finite"),
        (dict(bits="4"), TypeError, r"bits must be a number.*str"),
        (dict(bits=True), TypeError, r"bits must be a number.*bool"),
        (dict(seed=-1), ValueError, r"seed=-1"),
        (dict(seed=10**23), ValueError, r"seed=1000000"),
        (dict(seed=1.5), TypeError, r"seed must be an int"),
        (dict(key_bits=9), ValueError, r"key_bits=9"),
        (dict(value_bits=0), ValueError, r"value_bits=0"),
        (dict(key_bits=2.5), ValueError, r"key_bits=2\.5.*integers"),
        (dict(value_bits="8"), TypeError, r"value_bits must be a number"),
    ],
    ids=str,
)
def test_constructor_and_configured_reject_bad_configurations(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        Impl([0, 1], **kwargs)
    with pytest.raises(error, match=pattern):
        Impl.configured(**kwargs)


# ---------------------------------------------------------------- update inputs


def test_a_rejected_first_update_builds_no_codec(rng):
    """Regression: head_dim 0 once built codecs of dim 0 and bricked the cache."""
    ls = Lockstep.new([0, 1])
    bad = mx.zeros((2, 2, 3, 0))
    assert_rejected(ls.tq, lambda: ls.tq.update_and_fetch(bad, bad), ValueError, r"head_dim is 0")
    assert ls.tq.key_codec is None and ls.tq.value_codec is None
    ls.update(rng, 3)
    ls.check()


@pytest.mark.parametrize(
    "make,error,pattern",
    [
        (lambda k: np.array(k), TypeError, r"mlx\.core\.array.*ndarray"),
        (lambda k: k.tolist(), TypeError, r"mlx\.core\.array.*list"),
        (lambda k: k.astype(mx.int32), TypeError, r"dtype int32"),
        (lambda k: k.astype(mx.bool_), TypeError, r"dtype bool"),
    ],
    ids=["numpy", "list", "int32", "bool"],
)
@pytest.mark.parametrize("empty", [True, False], ids=["empty", "filled"])
def test_update_rejects_inputs_of_the_wrong_kind(make, error, pattern, empty, rng):
    """Regression: numpy inputs once changed meta_state (codecs built) before failing."""
    ls = Lockstep.new([0, 1, 0]) if empty else Lockstep.merge([2, 4, 1], rng)
    keys = normal(rng, (3, 2, 2, 64))
    assert_rejected(ls.tq, lambda: ls.tq.update_and_fetch(make(keys), make(keys)), error, pattern)
    then_still_in_lockstep(ls, rng)


@pytest.mark.parametrize("dim", [4096, 100_000])
def test_update_rejects_a_head_dim_no_codec_is_built_for(dim, rng):
    ls = Lockstep.new([0, 0])
    big = mx.zeros((2, 1, 1, dim))
    start = time.perf_counter()
    assert_rejected(ls.tq, lambda: ls.tq.update_and_fetch(big, big), ValueError, r"1 to 1024")
    # No codec was built: building one at head_dim 4096 takes ~24 s. (Not a
    # timing goal; a structural bound 100x above the rejection's microseconds.)
    assert time.perf_counter() - start < 5.0
    then_still_in_lockstep(ls, rng)


# ---------------------------------------------------------------- state


def _malformed_states(tq):
    keys, values, offset, left_padding = tq.state
    return {
        "int32 indices": (TurboQuantMSEState(keys.norms, keys.indices.astype(mx.int32)), TypeError, r"indices.*int32.*uint32"),
        "float indices": (TurboQuantMSEState(keys.norms, keys.indices.astype(mx.float32)), TypeError, r"uint32"),
        "int norms": (TurboQuantMSEState(keys.norms.astype(mx.int32), keys.indices), TypeError, r"norms.*int32"),
        "bfloat16 norms": (TurboQuantMSEState(keys.norms.astype(mx.bfloat16), keys.indices), TypeError, r"norms.*bfloat16"),
        "missing norms": (TurboQuantMSEState(None, keys.indices), TypeError, r"norms must be an mlx"),
        "numpy leaves": (TurboQuantMSEState(np.array(keys.norms), np.array(keys.indices)), TypeError, r"ndarray"),
        "one leaf": ([keys.indices], TypeError, r"packed state"),
        "norms of another shape": (TurboQuantMSEState(keys.norms[:, :1], keys.indices), ValueError, r"norms .* and indices"),
        "narrower words": (TurboQuantMSEState(keys.norms, keys.indices[..., :-1]), ValueError, r"packed width"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        "int32 indices",
        "float indices",
        "int norms",
        "bfloat16 norms",
        "missing norms",
        "numpy leaves",
        "one leaf",
        "norms of another shape",
        "narrower words",
    ],
)
def test_state_setter_rejects_packed_states_of_the_wrong_kind(batch, case, rng):
    """Regression: int32 indices once came back as keys off by up to 15.5, silently."""
    tq = batch.tq
    bad_keys, error, pattern = _malformed_states(tq)[case]
    _, values, offset, left_padding = tq.state

    def assign():
        tq.state = (bad_keys, values, offset, left_padding)

    assert_rejected(tq, assign, error, pattern)
    then_still_in_lockstep(batch, rng)


# ---------------------------------------------------------------- meta_state


def _bad_meta(meta):
    end, bits, seed, key_bits, value_bits, key_dim, value_dim, pending = meta
    return {
        "bits 16": (meta[:1] + ("16.0",) + meta[2:], ValueError, r"bits=16"),
        "bits inf": (meta[:1] + ("inf",) + meta[2:], ValueError, r"finite"),
        "bits nan": (meta[:1] + ("nan",) + meta[2:], ValueError, r"finite"),
        "head_dim 4096": (meta[:5] + ("4096", "4096", pending), ValueError, r"head_dim is 4096"),
        "head_dim 1e5": (meta[:5] + ("100000", "100000", pending), ValueError, r"head_dim is 100000"),
        "one head_dim": (meta[:5] + ("64", "0", pending), ValueError, r"both known or both 0"),
        "seed 1e23 as float": (meta[:2] + ("1e23",) + meta[3:], ValueError, r"seed .* not an integer"),
        "seed 10**23": (meta[:2] + (str(10**23),) + meta[3:], ValueError, r"seed=1000"),
        "negative seed": (meta[:2] + ("-3",) + meta[3:], ValueError, r"seed=-3"),
        "key_bits 9": (meta[:3] + ("9.0",) + meta[4:], ValueError, r"key_bits=9"),
        "None field": (meta[:2] + (None,) + meta[3:], TypeError, r"seed must be a string"),
        "pending not a string": (meta[:7] + (None,), TypeError, r"right padding must be a string"),
        "pending not numbers": (meta[:7] + ("a,b",), ValueError, r"right padding .* not an integer"),
        "None": (None, TypeError, r"meta_state must be a tuple"),
        "a string": ("3,4.0,0", TypeError, r"meta_state must be a tuple"),
        "empty": ((), ValueError, r"8 fields"),
    }  # fmt: skip


BAD_META = list(_bad_meta(("0",) * 8))


@pytest.mark.parametrize("case", BAD_META)
def test_meta_state_setter_rejects_fields_before_building_anything(batch, case, rng):
    tq = batch.tq
    value, error, pattern = _bad_meta(tuple(tq.meta_state))[case]

    def assign():
        tq.meta_state = value

    assert_rejected(tq, assign, error, pattern)
    then_still_in_lockstep(batch, rng)


@pytest.mark.parametrize("case", BAD_META)
def test_from_state_rejects_the_same_with_typed_errors(batch, case):
    """Regression: from_state once read meta_state[1] first (IndexError, OverflowError)."""
    value, error, pattern = _bad_meta(tuple(batch.tq.meta_state))[case]
    with pytest.raises(error, match=pattern):
        Impl.from_state(batch.tq.state, value)


# ---------------------------------------------------------------- files


def _file(tmp_path, batch, name="cache.safetensors"):
    path = tmp_path / name
    save_batch_cache(path, batch.tq)
    return path


@pytest.mark.parametrize("name", ["cache", "cache.bin", "cache.safetensors"])
def test_save_and_load_use_the_path_as_given(tmp_path, batch, name):
    """Regression: a suffix-less path was saved as path.safetensors and then not found."""
    path = _file(tmp_path, batch, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    restored = load_batch_cache(path)
    # Everything but the spare capacity (nbytes): a file holds the written slots only.
    want, got = observe(batch.tq), observe(restored)
    assert got.pop("nbytes") <= want.pop("nbytes")
    assert got == want
    assert isinstance(restored, tqbatch.BatchTurboQuantKVCache)


def _rewrite(path, arrays=None, metadata=None):
    old_arrays, old_meta = mx.load(str(path), format="safetensors", return_metadata=True)
    mx.eval(list(old_arrays.values()))  # read before the file is rewritten
    arrays = old_arrays if arrays is None else arrays(old_arrays)
    metadata = old_meta if metadata is None else metadata(old_meta)
    with open(path, "wb") as f:
        mx.save_safetensors(f, arrays, metadata)


def _meta_field(index, value):
    def edit(meta):
        fields = json.loads(meta["tqbatch.meta_state"])
        fields[index] = value
        return {"tqbatch.meta_state": json.dumps(fields)}

    return edit


def _without(key):
    return lambda arrays: {k: v for k, v in arrays.items() if k != key}


FILE_CASES = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:100]), r"not a readable safetensors"),
    "not safetensors": (lambda p: p.write_bytes(b"hello, world" * 10), r"not a readable"),
    "foreign": (lambda p: _rewrite(p, metadata=lambda m: {}), r"not written by tqbatch"),
    "metadata {}": (lambda p: _rewrite(p, metadata=lambda m: {"tqbatch.meta_state": "{}"}), r"list of strings"),
    "metadata null": (lambda p: _rewrite(p, metadata=lambda m: {"tqbatch.meta_state": "null"}), r"list of strings"),
    "metadata not JSON": (lambda p: _rewrite(p, metadata=lambda m: {"tqbatch.meta_state": "[1,"}), r"not JSON"),
    "bits inf": (lambda p: _rewrite(p, metadata=_meta_field(1, "inf")), r"finite"),
    "seed 10**23": (lambda p: _rewrite(p, metadata=_meta_field(2, str(10**23))), r"seed="),
    "head_dim 4096": (lambda p: _rewrite(p, metadata=_meta_field(5, "4096")), r"head_dim is 4096"),
    "no offset": (lambda p: _rewrite(p, arrays=_without("offset")), r"lacks the arrays \['offset'\]"),
    "no norms": (lambda p: _rewrite(p, arrays=_without("keys.0")), r"keys must be the two arrays"),
    "int32 indices": (lambda p: _rewrite(p, arrays=lambda a: {**a, "keys.1": a["keys.1"].astype(mx.int32)}), r"uint32"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_load_rejects_a_malformed_file_with_a_value_error(tmp_path, batch, case):
    path = _file(tmp_path, batch)
    spoil, pattern = FILE_CASES[case]
    spoil(path)
    with pytest.raises(ValueError, match=pattern) as info:
        load_batch_cache(path)
    assert str(path) in str(info.value)


def test_load_of_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_batch_cache(tmp_path / "nope.safetensors")
