"""Helpers of the end-to-end tests (fixtures live in ``conftest``)."""

from __future__ import annotations


def drain(gen, late=None):
    """Run mlx-lm's ``BatchGenerator`` ``gen`` to completion, calling ``late()`` after its
    second step. Returns, per uid, the tokens, the logprobs and the finished prompt caches."""
    tokens, logprobs, caches, step = {}, {}, {}, 0
    while responses := gen.next_generated():
        step += 1
        if step == 2 and late is not None:
            late()
        for r in responses:
            tokens.setdefault(r.uid, []).append(r.token)
            logprobs.setdefault(r.uid, []).append(r.logprobs)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    return tokens, logprobs, caches
