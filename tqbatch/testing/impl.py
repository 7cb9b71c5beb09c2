"""Which cache the harness tests, and what that cache can do.

``load_impl`` resolves the target class from an argument, ``$TQBATCH_IMPL`` or
the default (tqbatch's own class); ``impl_spec`` is the inverse, the one way a
target is named in reports, saved scenarios and shard configurations.
``capabilities`` finds out which operations of the op vocabulary (docs/ops.md)
the class offers, so that the state machine skips rules for missing ones and
reports them instead of crashing.
"""

from __future__ import annotations

import importlib
import inspect
import os

__all__ = [
    "DEFAULT_IMPL",
    "ENV_VAR",
    "OPS_BY_CAPABILITY",
    "ImplSpecError",
    "capabilities",
    "impl_spec",
    "load_impl",
    "missing_capabilities",
]

ENV_VAR = "TQBATCH_IMPL"
DEFAULT_IMPL = "tqbatch:BatchTurboQuantKVCache"


class ImplSpecError(ValueError):
    """A ``module:Class`` specification that does not name a usable class."""


def impl_spec(impl: type) -> str:
    """``"module:QualName"``: what ``load_impl`` takes to load ``impl`` again."""
    return f"{impl.__module__}:{impl.__qualname__}"


def load_impl(spec: str | None = None) -> type:
    """The cache class named by ``spec``, else ``$TQBATCH_IMPL``, else tqbatch's own.

    ``spec`` is ``"package.module:ClassName"``; the class may be nested
    (``module:Outer.Inner``). Raises ``ImplSpecError`` saying what is wrong.
    """
    source = "argument"
    if not spec:
        spec, source = os.environ.get(ENV_VAR) or None, f"${ENV_VAR}"
    if not spec:
        spec, source = DEFAULT_IMPL, "default"
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise ImplSpecError(
            f"implementation {spec!r} (from {source}) must be 'module:Class', "
            "e.g. 'tqbatch:BatchTurboQuantKVCache'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImplSpecError(
            f"implementation {spec!r} (from {source}): cannot import module {module_name!r}: {exc}"
        ) from exc
    obj = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImplSpecError(
                f"implementation {spec!r} (from {source}): module {module_name!r} "
                f"has no attribute {qualname!r}"
            ) from None
    if not inspect.isclass(obj):
        raise ImplSpecError(
            f"implementation {spec!r} (from {source}) is a {type(obj).__name__}, not a class"
        )
    for required in ("update_and_fetch", "make_mask"):
        if not callable(getattr(obj, required, None)):
            raise ImplSpecError(
                f"implementation {spec!r} (from {source}) has no {required}(): not a batch KV cache"
            )
    return obj


def _has_method(cls: type, name: str) -> bool:
    return callable(getattr(cls, name, None))


def _has_settable_property(cls: type, name: str) -> bool:
    prop = inspect.getattr_static(cls, name, None)
    return isinstance(prop, property) and prop.fset is not None


# Capability -> ops of the vocabulary that need it. An op runs only when all
# the capabilities it needs are present.
OPS_BY_CAPABILITY = {
    "merge": ("merge",),
    "prepare": ("prepare",),
    "finalize": ("finalize",),
    "filter": ("filter",),
    "extend": ("extend",),
    "extract": ("extract",),
    "trim": ("trim",),
    "roundtrip": ("roundtrip",),
    "dequantize": (),  # needed by checks, not by an op
}


def capabilities(cls: type) -> dict[str, bool]:
    """Which optional operations ``cls`` offers, by name (see ``OPS_BY_CAPABILITY``).

    Found by inspection of the class (methods, classmethods, property setters):
    nothing is instantiated.
    """
    return {
        "merge": _has_method(cls, "merge"),
        "prepare": _has_method(cls, "prepare"),
        "finalize": _has_method(cls, "finalize"),
        "filter": _has_method(cls, "filter"),
        "extend": _has_method(cls, "extend"),
        "extract": _has_method(cls, "extract"),
        "trim": _has_method(cls, "trim"),
        "roundtrip": _has_settable_property(cls, "state")
        and _has_settable_property(cls, "meta_state"),
        "dequantize": _has_method(cls, "dequantize"),
    }


def missing_capabilities(cls: type) -> list[str]:
    """Names of the capabilities ``cls`` lacks, sorted."""
    return sorted(name for name, ok in capabilities(cls).items() if not ok)
