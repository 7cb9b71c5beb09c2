"""Run a function on a module once it is imported: now if it already is, else right after.

The harness must change how mlx and mlx-vlm behave for a whole run (the CPU
lane keeps mlx-vlm's Metal kernels off; a simulated Mac pretends Metal is
there) without importing mlx itself: MLX reads ``MLX_ENABLE_TF32`` once, so
importing it early would fix the precision before the entry point chooses
it (``tqbatch.testing.backend.select_precision``). A finder on
``sys.meta_path`` wraps the module's loader, so the function runs after the
module body and before the importer sees the module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable

__all__ = ["after_import"]

_pending: dict[str, list[Callable]] = {}
_lock = threading.Lock()


def after_import(name: str, function: Callable) -> None:
    """Call ``function(module)`` once module ``name`` is imported (at once if it is)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
        module = None  # mid-import (a circular import): wait for its loader to finish
    if module is not None:
        function(module)
        return
    with _lock:
        _pending.setdefault(name, []).append(function)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: gives a pending module the real spec with a wrapped loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            functions = _pending.pop(self._name, [])
        for function in functions:
            function(module)

    def __getattr__(self, attribute):
        # get_resource_reader, is_package and the like: the real loader's.
        return getattr(self._loader, attribute)
