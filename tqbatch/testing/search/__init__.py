"""The search: Hypothesis drives the op vocabulary against a target to find failures.

``stateful`` (the state machine), ``machine_observer`` (what it saw over a
run), ``campaign`` (fuzz and survey: the engine behind ``tqbatch fuzz``),
``minimize`` (op-level minimization after Hypothesis's shrink), ``shards`` (a
campaign over processes), ``databases`` (example databases campaigns share),
``profiles`` (Hypothesis settings profiles), ``scheduling`` (how a survey
process asks the OS to schedule it), ``survey_process`` (a survey process's
entry point, which does so first) and ``hypothesis_internals``
(every use of Hypothesis's internals, in one module).
"""
