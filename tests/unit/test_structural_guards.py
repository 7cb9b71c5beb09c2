"""Structural guards instead of timed tests (speed goals are benchmarks): reshaping operations
move packed bits and never run a codec; a write quantizes its new tokens once.

Calls are counted by wrapping the codec classes' quantize/dequantize and
tqbatch's vectorized codec (``tqbatch._codec``, which stands in for them), so
any path (a helper, a parent-class method, a fallback) that reaches a codec
counts, once.
"""

from __future__ import annotations

from collections import Counter

import pytest
from mlx_vlm import turboquant

from tqbatch import _codec

from .support import Lockstep

CODEC_CLASSES = [
    turboquant._TurboQuantMSECodec,
    turboquant._TurboQuantProdCodec,
    turboquant._SplitCodec,
]


@pytest.fixture
def codec_calls(monkeypatch) -> Counter:
    """Counter of quantize/dequantize calls on any TurboQuant codec, by method name."""
    calls: Counter = Counter()
    inside = [0]  # tqbatch._codec falls back to the codec's method: count that call once

    def counted(original, name):
        def counting(*args, **kwargs):
            if not inside[0]:
                calls[name] += 1
            inside[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] -= 1

        return counting

    for name in ("quantize", "dequantize"):
        monkeypatch.setattr(_codec, name, counted(getattr(_codec, name), name))
        for cls in CODEC_CLASSES:
            monkeypatch.setattr(cls, name, counted(getattr(cls, name), name))
    return calls


def _prefilled(rng, bits=4.0) -> Lockstep:
    ls = Lockstep.new([0, 0, 0], bits=bits)
    ls.prepare(right_padding=[2, 0, 1])
    ls.update(rng, 5)
    return ls


def _finalize(ls, rng):
    ls.finalize()


def _filter(ls, rng):
    ls.finalize()
    ls.filter([2, 1])


def _filter_pending(ls, rng):
    ls.tq.filter([0, 2])


def _extend(ls, rng):
    ls.finalize()
    other = Lockstep.merge([7, 2], rng, bits=ls.bits)
    # building `other` quantized its tokens: only the extend itself is measured
    return lambda: ls.extend(other)


def _extract(ls, rng):
    ls.finalize()
    for i in range(ls.batch):
        ls.tq.extract(i)


def _trim(ls, rng):
    ls.finalize()
    ls.trim(2)


def _roundtrip(ls, rng):
    ls.finalize()
    ls.roundtrip()


OPS = {
    "finalize": _finalize,
    "filter": _filter,
    "filter with padding pending": _filter_pending,
    "extend": _extend,
    "extract": _extract,
    "trim": _trim,
    "state round trip": _roundtrip,
}


@pytest.mark.parametrize("bits", [3.5, 4])
@pytest.mark.parametrize("op", list(OPS))
def test_reshaping_never_runs_a_codec(op, bits, rng, codec_calls):
    ls = _prefilled(rng, bits)
    run = OPS[op]
    if op == "extend":
        measured = run(ls, rng)
        codec_calls.clear()
        measured()
    else:
        codec_calls.clear()
        run(ls, rng)
    assert codec_calls == Counter(), f"{op} ran codecs: {dict(codec_calls)}"
    if op != "filter with padding pending":
        ls.check()  # and it did its job


@pytest.mark.parametrize("lengths", [[4, 0, 2], [0, 0], [3]], ids=str)
def test_merge_never_runs_a_codec(lengths, rng, codec_calls):
    from mlx_vlm.turboquant import TurboQuantKVCache

    from .support import Impl, normal

    members = []
    for n in lengths:
        c = TurboQuantKVCache(bits=4.0)
        if n:
            c.update_and_fetch(normal(rng, (1, 2, n, 64)), normal(rng, (1, 2, n, 64)))
        members.append(c)
    codec_calls.clear()
    Impl.merge(members)
    assert codec_calls == Counter()


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_write_quantizes_once_per_side_and_never_dequantizes(batch, tokens, rng, codec_calls):
    """No hidden overhead in decode, B = 1 included: one quantize of the new
    keys, one of the new values, nothing re-quantized, nothing dequantized."""
    ls = Lockstep.merge([3] * batch, rng)
    ls.update(rng, 2)  # codecs exist, buffers have spare capacity
    codec_calls.clear()
    ls.update(rng, tokens)
    assert codec_calls == Counter(quantize=2)
    ls.check()


def test_a_write_trim_loop_keeps_its_buffers(rng):
    """Speculative decoding writes a draft and trims the rejected part, step after step:
    the buffers stay the ones allocated (no growth per round, no re-allocation)."""
    ls = Lockstep.merge([6, 3], rng)
    ls.update(rng, 1)
    before = ls.tq.nbytes
    for _ in range(40):
        ls.update(rng, 3)
        ls.trim(3)
    assert ls.tq.nbytes == before
    ls.check()
