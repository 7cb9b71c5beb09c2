"""Which cache the harness tests, and what that cache can do.

``load_impl`` resolves the target class from an argument, ``$TQBATCH_IMPL`` or
the default (tqbatch's own class), by ``module:Class`` or by a short name of
``ALIASES`` (``tqbatch``, ``mlx-vlm``); ``impl_spec`` is the inverse, the one
way a target is named in reports, saved scenarios and shard configurations.
``capabilities`` finds out which operations of the op vocabulary (docs/ops.md)
the class offers, so that the state machine skips rules for missing ones and
reports them instead of crashing, and which configurations its constructor
can take (``CONFIGURATIONS``: split key/value bits, a codec seed), so that
configurations it cannot take are not drawn and are reported as unsupported,
not as a defect.
"""

from __future__ import annotations

import importlib
import inspect
import os

__all__ = [
    "ALIASES",
    "CONFIGURATIONS",
    "DEFAULT_IMPL",
    "ENV_VAR",
    "ImplSpecError",
    "capabilities",
    "impl_spec",
    "load_impl",
    "missing_capabilities",
    "resolve_alias",
    "unsupported_configurations",
]

ENV_VAR = "TQBATCH_IMPL"
DEFAULT_IMPL = "tqbatch:BatchTurboQuantKVCache"

# Short names every command takes for a target (``--impl``, ``$TQBATCH_IMPL``,
# ``conformance`` targets): the caches the README compares.
ALIASES = {
    "tqbatch": "tqbatch.cache:BatchTurboQuantKVCache",
    "mlx-vlm": "mlx_vlm.turboquant:BatchTurboQuantKVCache",
}


class ImplSpecError(ValueError):
    """A ``module:Class`` specification that does not name a usable class."""


def resolve_alias(spec: str) -> str:
    """``spec``'s ``module:Class`` where it is a short name of ``ALIASES``, else ``spec``."""
    return ALIASES.get(spec, spec)


def impl_spec(impl: type) -> str:
    """``"module:QualName"``: what ``load_impl`` takes to load ``impl`` again."""
    return f"{impl.__module__}:{impl.__qualname__}"


def load_impl(spec: str | None = None) -> type:
    """The cache class named by ``spec``, else ``$TQBATCH_IMPL``, else tqbatch's own.

    ``spec`` is ``"package.module:ClassName"`` (the class may be nested,
    ``module:Outer.Inner``) or a short name of ``ALIASES``. Raises
    ``ImplSpecError`` saying what is wrong.
    """
    source = "argument"
    if not spec:
        spec, source = os.environ.get(ENV_VAR) or None, f"${ENV_VAR}"
    if not spec:
        spec, source = DEFAULT_IMPL, "default"
    if spec in ALIASES:
        spec, source = ALIASES[spec], f"{source}, alias {spec!r}"
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise ImplSpecError(
            f"implementation {spec!r} (from {source}) must be 'module:Class', "
            f"e.g. 'tqbatch:BatchTurboQuantKVCache', or one of {', '.join(map(repr, ALIASES))}"
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


# Capability -> the configuration it lets the harness draw, as reports name it.
# Optional constructor parameters: a cache without them is reported as unable
# to take those configurations, never as defective, and none is drawn for it.
# A cache without a ``seed`` parameter is taken to quantize with seed 0 (the
# default of tqbatch's and mlx-vlm's caches).
CONFIGURATIONS = {
    "split_bits": "split key/value bits",
    "seed": "a codec seed other than 0",
}


def _constructor_takes(cls: type) -> dict[str, bool]:
    """Which optional keywords the constructor of ``cls`` takes (``**kwargs`` takes any)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read (e.g. built in C): assume all
        return dict.fromkeys(("key_bits", "value_bits", "seed"), True)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict.fromkeys(("key_bits", "value_bits", "seed"), True)
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {name: name in named for name in ("key_bits", "value_bits", "seed")}


def capabilities(cls: type) -> dict[str, bool]:
    """Which optional operations ``cls`` offers, by name (an op declares the ones it
    needs: ``tqbatch.testing.contract.ops``), and
    which configurations its constructor takes (see ``CONFIGURATIONS``).

    Found by inspection of the class (methods, classmethods, property setters,
    the constructor's signature): nothing is instantiated.
    """
    takes = _constructor_takes(cls)
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
        "split_bits": takes["key_bits"] and takes["value_bits"],
        "seed": takes["seed"],
    }


def missing_capabilities(cls: type) -> list[str]:
    """Names of the operation capabilities ``cls`` lacks, sorted (configurations it cannot
    take: ``unsupported_configurations``)."""
    return sorted(
        name for name, ok in capabilities(cls).items() if not ok and name not in CONFIGURATIONS
    )


def unsupported_configurations(cls: type) -> list[str]:
    """The configurations ``cls``'s constructor cannot take, as reports name them
    (e.g. ``"split key/value bits"``)."""
    caps = capabilities(cls)
    return [what for name, what in CONFIGURATIONS.items() if not caps[name]]
