"""The state machine against the target under test ($TQBATCH_IMPL or --impl; default tqbatch)."""

from tqbatch.testing.search.stateful import machine_test_case

# Runs under the active Hypothesis profile (`ci` when CI is set, else `dev`).
TestBatchCacheMachine = machine_test_case()
