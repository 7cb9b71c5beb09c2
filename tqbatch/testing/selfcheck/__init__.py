"""The harness checking itself: does it find bugs, and does it pass correct caches.

``selftest`` (the mutant catalogue, ``tqbatch.testing.mutants``, hunted one
by one: found, by its check, how fast), ``mlx_vlm_regressions`` (one method
of mlx-vlm's batch cache broken each) and ``doubles`` (correct caches that
round otherwise).
"""
