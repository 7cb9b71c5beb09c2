"""Sub-commands of the ``tqbatch`` CLI, one module each.

Every public module here defines ``register(subparsers)`` (adds its
sub-parser and ``set_defaults(func=run)``) and ``run(args) -> int`` (the exit
code). :mod:`tqbatch.cli` discovers them with :mod:`pkgutil`; modules whose
names start with ``_`` are helpers, not commands.
"""
