"""``Failure``: one record of a failure, from the check that raised it to the JSON a run saves.

A check raises a ``CheckFailure`` (``contract.checks``); the state machine
records it with the example's configuration and ops; a campaign adds what it
knows (the identities ``tolerated`` when it was found, whether it was
``replayed`` from an example database) and cuts its ops down; a conformance
test adds the command that reproduces it (``repro``); shard results and
saved campaigns carry it as JSON (``to_json``/``from_json``). Every reader
takes its fields, whichever of these steps it comes after.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from tqbatch.testing.contract.checks import HARNESS, CheckFailure

__all__ = ["Failure"]


@dataclass
class Failure:
    """What failed, where, and how to replay it.

    ``identity`` is ``check@op`` ("" for a failure no check raised: a crash
    of the harness itself, a model cell), ``level`` contract, policy or
    harness, ``what`` what failed in a sentence and ``message`` the whole
    message raised. ``impl``, ``config`` and ``ops`` replay it (``ops`` None:
    not found by an op sequence); ``also`` the identities of the other checks
    that failed after the same op; ``final`` whether Hypothesis was replaying
    its shrunk example when it was recorded.
    """

    identity: str = ""
    level: str = HARNESS
    what: str = ""
    message: str = ""
    check: str = ""
    impl: str = ""
    config: dict = field(default_factory=dict)
    ops: list | None = None
    also: list[str] = field(default_factory=list)
    final: bool = False
    tolerated: list[str] = field(default_factory=list)  # identities tolerated when found
    replayed: bool = False  # found replaying an example database
    repro: str | None = None  # the command that reproduces it, once saved

    @classmethod
    def of(cls, exc: BaseException, **where) -> Failure:
        """The record of ``exc``: a check's failure by its identity, anything else as a
        failure of the harness; ``where`` sets the other fields (impl, config, ops...)."""
        if isinstance(exc, CheckFailure):
            return cls(
                identity=exc.identity,
                level=exc.level,
                what=exc.what,
                message=str(exc),
                check=exc.check.name,
                also=[f.identity for f in exc.also],
                **where,
            )
        return cls(message=f"{type(exc).__name__}: {exc}", **where)

    @property
    def key(self) -> str:
        """What failures are listed and told apart by: the identity, or the message where
        there is none."""
        return self.identity or self.message

    @property
    def summary(self) -> str:
        """What failed, its first line."""
        text = self.what or self.message
        return text.splitlines()[0] if text else ""

    def line(self) -> str:
        """``identity [level, N ops]: what failed``, and the repro command under it."""
        ops = f", {len(self.ops)} ops" if self.ops is not None else ""
        text = f"{self.identity or '(no identity)'} [{self.level}{ops}]: {self.summary}"
        return text + (f"\n    reproduce: {self.repro}" if self.repro else "")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Failure:
        """The record ``to_json`` wrote; keys it does not know are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"not fields of a failure record: {', '.join(unknown)}")
        return cls(**data)
