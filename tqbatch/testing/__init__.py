"""tqbatch.testing: a reusable harness that checks any batched quantized KV cache.

Point it at an implementation with ``TQBATCH_IMPL=module:Class`` (or pytest's
``--impl``); the default is ``tqbatch.BatchTurboQuantKVCache``.
"""
