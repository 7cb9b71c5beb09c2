"""The gate: a cache owner's CI verdict on the target.

``plugin`` (tqbatch's pytest plugin, whose tests are ``tqbatch.conformance``),
``known_failures`` (the failures a target is expected to have) and ``junit``
(a campaign's result as JUnit XML).
"""
