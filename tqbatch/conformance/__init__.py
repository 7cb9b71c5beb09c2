"""The conformance tests tqbatch's pytest plugin (``tqbatch.testing.gate.plugin``) runs on a cache.

    python -m pytest --pyargs tqbatch.conformance --tqbatch-impl mypkg.cache:MyCache

Against the cache under test, one module each:

- ``test_bad_input.py::test_bad_input[CASE]``: each case of the bad-input
  catalogue (``tqbatch.testing.contract.ops.BAD_INPUT_ERRORS``) on a batch of
  three rows with tokens written: rejected with the documented error, the
  cache left exactly as it was, and still in lockstep with the oracles after
  a decode step.
- ``test_golden.py::test_golden[NAME]``: each golden scenario shipped with
  tqbatch (``tqbatch.testing.replay.golden``), replayed against the live oracles
  and its recording (``--tqbatch-oracles-only``: the oracles alone).
- ``test_state_machine.py::test_state_machine``: a survey of the Hypothesis
  state machine (``tqbatch.testing.search.campaign``, as ``tqbatch fuzz --survey``):
  every distinct failing check, each shrunk within the run-counted bound
  (``SHRINK_RUNS``) and then op by op, so that a failure is reported as
  soon as on the command line, at any machine speed.
- ``test_models.py::test_model_family[FAMILY-SCENARIO]``
  (``--tqbatch-models``): the cache inside mlx-vlm's own model code
  (``tqbatch.workbench.model_matrix``); it must pass wherever mlx-lm's
  ``BatchKVCache`` passes.

They run in that order (the plugin sorts them), the fast, deterministic
ones first, so that a broken cache fails within seconds. What they share
(the session's ``Harness``, the verdict) is ``tqbatch.testing.gate.session``;
what each found is a ``tqbatch.testing.contract.failure.Failure``.

Each failure a test finds has an identity (``check@op``,
``tqbatch.testing.contract.checks``). One listed in the known failures makes
the test an expected failure (xfail, with the listed reason); one not listed
fails it, naming the identity and, where there is an op sequence to replay,
a scenario file saved under ``--tqbatch-failures`` with the command that
reproduces it. Which listed failures a test may show is declared on it (the
marker ``tqbatch_expects``): a bad-input test those of its case, the survey
every other one. A policy difference (a cache may have another legal
policy: ``tqbatch.testing.contract.checks``) does not fail a test: it is an
xfail saying so, as ``tqbatch conformance`` lists it without failing.
Failures of the model matrix, and golden divergences from a recording
rather than from a check, have no identity: they fail whatever is listed.
"""
