"""The contract: what a batched cache must do, op by op, and how a failure is named.

``checks`` (the check vocabulary: names, levels, identities, the failure
raised), ``ops/`` (the op vocabulary of docs/ops.md, one module per op, and
the catalogues built over every op: checks, bad inputs), ``invariants``
(the checks every op is held to), ``observation`` (what a replay records of
each step) and ``strategies`` (Hypothesis strategies that need no op: a
leaf).
"""
