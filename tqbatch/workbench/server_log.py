"""Which cache served which request, and whether requests shared a batch, from a server's log.

``tqbatch serve`` logs every batch cache the server builds (``batch of N rows
on CLASS``, or ``batch of N rows restored from the prefix cache on CLASS``
where mlx-vlm's prefix cache builds it), every join of two batches (``join:
A + B -> C``, or ``join failed: A + B: ERROR`` where it raised) and, where
mlx-lm's server serves one request at a time (with a draft model), ``one
request on CLASSES``.
mlx-vlm's server logs each request's ``Prefill started: request=ID ...
prompt_tokens=N`` just before the batch of its prefill group is built, and
``Decode completed: request=ID`` when it leaves. Read in order, a batch of N
rows serves the last N requests whose prefill started, and a join serves
every request still decoding. A request is known to its client by its
``prompt_tokens`` (the response's ``usage``), so a scenario gives its requests
distinct prompt lengths. mlx-lm's server logs no line per request, so there
``tqbatch serve`` names the rows' prompt lengths in the batch's own line
(``batch of N rows on CLASS, prompts of A, B tokens``), and having no line
for a request's end either, a join serves every request batched before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["BatchLog", "read_batch_log"]

_PREFILL = re.compile(r"Prefill started: request=(\S+) .*?prompt_tokens=(\d+)")
_DONE = re.compile(r"Decode completed: request=(\S+)")
_BATCH = re.compile(
    r"tqbatch serve: batch of (\d+) rows(?: restored from the prefix cache)? on (.+?)"
    r"(?:, prompts of ([\d, ]+) tokens)?$"
)
_JOIN = re.compile(r"tqbatch serve: join: .* -> (.+)$")
_JOIN_FAILED = re.compile(r"tqbatch serve: join failed: (.+)$")
_ONE = re.compile(r"tqbatch serve: one request on (.+)$")


def _short(classes: str) -> set[str]:
    """``a.b.C, d.E`` -> {``a.C``, ``d.E``}: each class by its package and name (mlx-vlm's
    and tqbatch's batch classes share a name)."""
    names = (name.strip() for name in classes.split(","))
    return {f"{name.split('.', 1)[0]}.{name.rsplit('.', 1)[-1]}" for name in names}


@dataclass
class BatchLog:
    """What a server's log says about its batches, per request (keyed by prompt length)."""

    served_by: dict[int, set[str]] = field(default_factory=dict)  # prompt tokens -> classes
    # Classes of batches and joins no request can be tied to (a line with no request
    # started before it, one request at a time): they served every request of the phase.
    unattributed: set[str] = field(default_factory=set)
    batch_rows: list[int] = field(default_factory=list)  # rows of each prefill group's batch
    joins: int = 0
    failed_joins: list[str] = field(default_factory=list)  # what each failed join raised
    # The most requests decoding at once, as the log orders them (where it says when each
    # request ends: mlx-vlm's server; 0 for mlx-lm's).
    most_in_flight: int = 0

    def classes_of(self, prompt_tokens: int | None) -> tuple[str, ...]:
        """The classes that served the request of ``prompt_tokens`` tokens, sorted."""
        return tuple(sorted(self.served_by.get(prompt_tokens, set()) | self.unattributed))

    def shared(self) -> bool:
        """Whether any two requests were in one batch (a group of 2+ rows, or a join)."""
        return self.joins > 0 or any(rows > 1 for rows in self.batch_rows)


def read_batch_log(text: str) -> BatchLog:
    """Follow ``text`` (a ``tqbatch serve`` log of mlx-vlm's server) line by line."""
    result = BatchLog()
    started: list[tuple[str, int]] = []  # prefill started, no batch yet
    decoding: dict[str, int] = {}  # request id -> prompt tokens
    for line in text.splitlines():
        if m := _PREFILL.search(line):
            started.append((m.group(1), int(m.group(2))))
        elif m := _BATCH.search(line):
            rows, classes = int(m.group(1)), _short(m.group(2))
            result.batch_rows.append(rows)
            if m.group(3):  # mlx-lm's: the rows' prompt lengths, in the line itself
                prompts = [int(n) for n in m.group(3).split(",")]
                group = [(f"row {len(decoding) + i}", n) for i, n in enumerate(prompts)]
            else:
                group, started = started[-rows:], started[:-rows] if rows else started
            if not group:
                result.unattributed |= classes
            for request, tokens in group:
                result.served_by.setdefault(tokens, set()).update(classes)
                decoding[request] = tokens
            if not m.group(3):  # mlx-lm's log says no request's end: none counted in flight
                result.most_in_flight = max(result.most_in_flight, len(decoding))
        elif m := _JOIN.search(line):
            result.joins += 1
            if not decoding:
                result.unattributed |= _short(m.group(1))
            for tokens in decoding.values():
                result.served_by.setdefault(tokens, set()).update(_short(m.group(1)))
        elif m := _ONE.search(line):
            result.unattributed |= _short(m.group(1))
        elif m := _JOIN_FAILED.search(line):
            result.failed_joins.append(m.group(1))
        elif m := _DONE.search(line):
            decoding.pop(m.group(1), None)
    return result
