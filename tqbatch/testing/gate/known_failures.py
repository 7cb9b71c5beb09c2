"""Known failures: the failures a target is expected to have, each with the reason it is known.

A cache's owner who gates CI on ``tqbatch conformance`` (or ``tqbatch fuzz
--known-failures``) lists what their cache is known to fail, so that the
gate fails only on what is new. The file format follows array-api-tests'
xfails file: one failure identity per line (``check@op``, or a standing
check such as ``size``: ``tqbatch.testing.contract.checks``), then `` # `` and the
reason, which is required; blank lines and lines that start with ``#`` are
comments::

    # mlx-vlm 0.7.10's BatchTurboQuantKVCache
    size              # size() is the allocated capacity, not the written end
    offset@roundtrip  # meta_state keeps one int offset

A run's failures are sorted against the list (``KnownFailures.triage``):

- ``known``: found and listed, reported as expected failures;
- ``new``: found and not listed: the run fails;
- ``fixed``: listed and not found: reported as no longer failing, so that
  the list stays true. It does not fail the run by itself: a survey with a
  small budget may simply not have reached a listed failure (the search
  ends examples at failures it already has, and a fixed seed reaches the
  same ones only with the same budget). A caller that wants a stale list to
  fail (pytest's strict xfail) says so: ``--strict-known-failures``.

Files shipped with tqbatch (``shipped``) list the failures of upstream
caches, e.g. ``mlx_vlm_0_7_10`` for mlx-vlm 0.7.10's class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "SHIPPED_DIR",
    "Triage",
    "KnownFailures",
    "KnownFailuresError",
    "format_known_failures",
    "shipped",
]


# The lists shipped as package data (pyproject's package-data).
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "known_failures"


class KnownFailuresError(ValueError):
    """A known-failures file that cannot be read or says something unclear; names the line."""


@dataclass(frozen=True)
class Triage:
    """A run's failures against a known-failures list (see the module docstring)."""

    known: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No new failure (listed failures that no longer fail do not count: ``strict_ok``)."""
        return not self.new

    @property
    def strict_ok(self) -> bool:
        """No new failure and no listed failure left unfound."""
        return not self.new and not self.fixed

    def to_json(self) -> dict:
        return {"known": list(self.known), "new": list(self.new), "fixed": list(self.fixed)}


@dataclass(frozen=True)
class KnownFailures:
    """Failure identities a target is known to have, each with its reason (identity -> reason)."""

    entries: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> KnownFailures:
        """No known failure: every failure found is new."""
        return cls({})

    @classmethod
    def load(cls, path) -> KnownFailures:
        """Read a known-failures file; ``KnownFailuresError`` names the file and line."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KnownFailuresError(f"{path}: cannot read the known-failures file: {exc}") from exc
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<known failures>") -> KnownFailures:
        """The list in ``text`` (the file format above); ``source`` names it in errors."""
        from tqbatch.testing.contract.ops import CHECKS

        entries: dict[str, str] = {}
        lines: dict[str, int] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{source}:{number}"
            identity, sep, reason = line.partition("#")
            identity, reason = identity.strip(), reason.strip()
            if not sep or not reason:
                raise KnownFailuresError(
                    f"{where}: {identity!r} has no reason: write it as "
                    f"'{identity}  # why this failure is known'"
                )
            check = identity.partition("@")[0]
            if check not in CHECKS:
                raise KnownFailuresError(
                    f"{where}: {identity!r} is not a failure identity: its check {check!r} "
                    f"is none of tqbatch.testing.contract.ops.CHECKS ({', '.join(sorted(CHECKS))})"
                )
            if identity in entries:
                raise KnownFailuresError(
                    f"{where}: {identity!r} is listed twice (first at line {lines[identity]})"
                )
            entries[identity], lines[identity] = reason, number
        return cls(entries)

    def triage(self, found: Iterable[str]) -> Triage:
        """Split the identities ``found`` (in the order found, repeats dropped) against the list."""
        seen = list(dict.fromkeys(found))
        known = [i for i in seen if i in self.entries]
        new = [i for i in seen if i not in self.entries]
        fixed = [i for i in self.entries if i not in set(seen)]
        return Triage(known=known, new=new, fixed=fixed)

    def merged(self, other: KnownFailures) -> KnownFailures:
        """Both lists in one (``other``'s reason where both list an identity)."""
        return KnownFailures({**self.entries, **other.entries})

    def __len__(self) -> int:
        return len(self.entries)


def format_known_failures(failures: Iterable[tuple[str, str]], header: Iterable[str] = ()) -> str:
    """A known-failures file listing ``(identity, reason)`` pairs, after ``header`` comment lines.

    A reason is kept to one line (``#`` and all: only the first ``#`` of a
    line ends its identity).
    """
    lines = [f"# {h}".rstrip() for h in header]
    pairs = [(identity, " ".join(str(reason).split()) or "-") for identity, reason in failures]
    width = max((len(identity) for identity, _ in pairs), default=0)
    lines += [f"{identity.ljust(width)}  # {reason}" for identity, reason in pairs]
    return "\n".join(lines) + "\n"


def shipped(name: str) -> Path | None:
    """The known-failures file shipped with tqbatch under ``name`` (e.g. ``mlx_vlm_0_7_10``,
    with or without ``.txt``), or None."""
    stem = name[:-4] if name.endswith(".txt") else name
    if not stem or "/" in stem or "\\" in stem:
        return None
    path = SHIPPED_DIR / f"{stem}.txt"
    return path if path.is_file() else None
