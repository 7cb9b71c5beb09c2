"""A ledger of the K/V every cache object is handed, whatever code hands it.

mlx-vlm's model code does not always write to the batch cache it was given:
qwen3_5 runs left-padded rows alone in caches it extracts (or in fresh
full-precision ``KVCache``s) and re-batches them with
``cache.__class__.merge(rows)``. A tap on the batch cache object would miss
those writes. The ledger instead wraps ``update_and_fetch`` on the *classes*
involved and ``merge`` on the batch class for the duration of a ``with``
block, so every write is recorded by the object that received it, and every
re-batch by the object it produced.

The wrappers call the original methods unchanged; nested calls an object
makes to itself, its own class's or a parent's, are recorded once.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field

import mlx.core as mx

__all__ = ["AttentionCall", "AttentionLog", "KVLedger", "MergeRecord"]


@dataclass(frozen=True)
class MergeRecord:
    """One ``merge(members)`` call and the batch it returned."""

    members: tuple
    result: object


def _defining_class(cls: type, name: str) -> type:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass
    raise AttributeError(f"{cls.__name__} has no {name}")


@dataclass
class KVLedger:
    """Records ``update_and_fetch`` on instances of ``classes`` and ``merge`` on ``batch_classes``.

    ``writes[id(obj)]`` is the list of ``(keys, values)`` obj was handed;
    ``merges`` the re-batches, in order. ``objects`` keeps every recorded
    object alive so that ``id`` values stay unique while the ledger lives.
    """

    classes: tuple[type, ...]
    batch_classes: tuple[type, ...] = ()
    writes: dict[int, list[tuple[mx.array, mx.array]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    merges: list[MergeRecord] = field(default_factory=list)
    objects: dict[int, object] = field(default_factory=dict)

    def __enter__(self) -> KVLedger:
        self._patched: list[tuple[type, str, object]] = []
        # One depth per object across every wrapped class: a subclass's
        # update_and_fetch that calls its parent's is one write, not two.
        self._depth: dict[int, int] = defaultdict(int)
        owners = {_defining_class(cls, "update_and_fetch") for cls in self.classes}
        for owner in owners:
            self._wrap_update(owner)
        merges = {_defining_class(c, "merge") for c in self.batch_classes if hasattr(c, "merge")}
        for owner in merges:
            if isinstance(owner.__dict__["merge"], classmethod):
                self._wrap_merge(owner)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def clear(self):
        self.writes.clear()
        self.merges.clear()
        self.objects.clear()

    def writes_to(self, obj) -> list[tuple[mx.array, mx.array]]:
        return list(self.writes.get(id(obj), ()))

    def merge_into(self, obj) -> MergeRecord | None:
        """The last merge whose result is ``obj``."""
        for record in reversed(self.merges):
            if record.result is obj:
                return record
        return None

    # ------------------------------------------------------------ wrapping

    def _wrap_update(self, owner: type):
        original = owner.__dict__["update_and_fetch"]
        depth = self._depth
        ledger = self

        def update_and_fetch(cache, keys, values, *args, **kwargs):
            key = id(cache)
            if depth[key] == 0:
                ledger.objects[key] = cache
                ledger.writes[key].append((keys, values))
            depth[key] += 1
            try:
                return original(cache, keys, values, *args, **kwargs)
            finally:
                depth[key] -= 1

        self._patched.append((owner, "update_and_fetch", original))
        owner.update_and_fetch = update_and_fetch

    def _wrap_merge(self, owner: type):
        original = owner.__dict__["merge"]
        function = original.__func__ if isinstance(original, classmethod) else original
        ledger = self

        def merge(cls, caches, *args, **kwargs):
            members = tuple(caches)
            result = function(cls, members, *args, **kwargs)
            ledger.objects[id(result)] = result
            for member in members:
                ledger.objects[id(member)] = member
            ledger.merges.append(MergeRecord(members, result))
            return result

        self._patched.append((owner, "merge", original))
        owner.merge = classmethod(merge)


@dataclass(frozen=True)
class AttentionCall:
    """One call of a model module's ``scaled_dot_product_attention``."""

    cache: object
    queries: mx.array
    output: mx.array
    scale: float
    sinks: mx.array | None


class AttentionLog:
    """Records every ``scaled_dot_product_attention`` call of the given modules.

    mlx-vlm's model code imports the function by name into its own modules,
    so the spy replaces that name in each module for the ``with`` block.
    """

    def __init__(self, modules):
        self.modules = list(modules)
        self.calls: list[AttentionCall] = []

    def __enter__(self) -> AttentionLog:
        self._originals = []
        for module in self.modules:
            original = module.scaled_dot_product_attention
            signature = inspect.signature(original)
            self._originals.append((module, original))
            module.scaled_dot_product_attention = self._spy(original, signature)
        return self

    def _spy(self, original, signature):
        def spy(*args, **kwargs):
            output = original(*args, **kwargs)
            arguments = signature.bind(*args, **kwargs).arguments
            self.calls.append(
                AttentionCall(
                    arguments.get("cache"),
                    arguments["queries"],
                    output,
                    float(arguments["scale"]),
                    arguments.get("sinks"),
                )
            )
            return output

        return spy

    def __exit__(self, *exc):
        for module, original in reversed(self._originals):
            module.scaled_dot_product_attention = original

    def calls_on(self, cache) -> list[AttentionCall]:
        return [c for c in self.calls if c.cache is cache]
