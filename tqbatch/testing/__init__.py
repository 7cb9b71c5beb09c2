"""tqbatch.testing: a reusable harness that checks any batched quantized KV cache.

Point it at an implementation with ``TQBATCH_IMPL=module:Class`` (or pytest's
``--impl``); the default is ``tqbatch.BatchTurboQuantKVCache``.

Importing the package takes the lane ``$TQBATCH_DEVICE`` names
(``tqbatch.testing.backend.lane``): on ``cpu`` no Metal kernel runs in the process,
mlx-vlm's included. It does not import mlx.
"""

from tqbatch.testing.backend import lane as _lane

_lane.honour_environment()
