"""tqbatch.testing: a reusable harness that checks any batched quantized KV cache.

Point it at an implementation with ``TQBATCH_IMPL=module:Class`` (or pytest's
``--impl``); the default is ``tqbatch.BatchTurboQuantKVCache``.

Words, as the harness uses them:

target
    The cache class under test, named ``module:Class`` (``target``).
op
    One operation of the vocabulary of docs/ops.md, a JSON dict (``merge``,
    ``update``, ``filter``...), declared once in its module of
    ``contract/ops/`` with its inputs, effects, checks and docs entry.
check
    One named property a target is held to after an op (``offset``,
    ``mask_values``, ``rejects``...), at a level: contract, policy or harness
    (``contract/checks``).
identity
    What a failure is told apart and listed by: ``check@op`` (or
    ``check@case`` for a bad input), or the check alone where it is a
    standing property of the cache.
failure
    One record (``contract/failure``) from the check that raised it to the
    JSON a run saves: identity, level, what failed, and the configuration
    and ops that replay it.
oracle
    What the target is compared with: mlx-lm's ``BatchKVCache`` in full
    precision, a single-request ``TurboQuantKVCache`` per request, a numpy
    model (``oracles/``).
judge
    One comparison of a target's numbers with an oracle's, within a derived
    tolerance (``oracles/judges``).
scenario
    A golden scenario: a named op sequence with its recording, replayed
    against any target (``replay/``). The workbench's serving scenarios
    (``tqbatch.workbench.model_matrix``) are another thing.
lane
    Where a run computes, CPU or GPU, and the custom kernels launched there
    (``backend/lane``).

The wings, bottom first (each imports only those below it;
tests/unit/test_import_direction.py holds them to it): ``target`` and
``backend/``; ``oracles/``; ``contract/``; the executor (``world``,
``collector``); ``replay/``; ``search/``; then ``gate/`` (a cache owner's CI)
and ``selfcheck/`` (the harness against its own ``mutants``).

Importing the package takes the lane ``$TQBATCH_DEVICE`` names
(``tqbatch.testing.backend.lane``): on ``cpu`` no Metal kernel runs in the process,
mlx-vlm's included. It does not import mlx.
"""

from tqbatch.testing.backend import lane as _lane

_lane.honour_environment()
