"""Example databases a campaign shares with other campaigns: ``tqbatch fuzz --database SPEC``.

Hypothesis saves every failing example (its choice sequence) under the
test's key in its example database and, in its reuse phase, replays what is
saved before generating anything new. Pointing many campaigns, on one
machine or many, at one database is how they share what they find: the
database is the only thing they share. ``open_database`` turns a spec into
one of Hypothesis's own databases:

- a directory path: ``DirectoryBasedExampleDatabase`` (on shared storage,
  every machine that mounts it shares it);
- ``redis://HOST:PORT/DB`` (or ``rediss://`` for TLS): a
  ``RedisExampleDatabase`` (needs the ``redis`` package, the ``redis`` extra);
- ``github:OWNER/REPO`` or ``github:OWNER/REPO/ARTIFACT``: the example
  database a GitHub Actions workflow uploaded as the artifact ``ARTIFACT``
  (default ``hypothesis-example-db``), read-only, multiplexed with a local
  directory (``local``, default ``.hypothesis/examples``) that receives what
  this run finds. The artifact is read with ``$GITHUB_TOKEN``.

A bad spec raises ``DatabaseSpecError`` (one line, for the CLI's usage error).

A spec may carry a password (``redis://:PASSWORD@HOST:PORT/DB``). It is
opened as given, but shown only as ``redact_url`` writes it
(``redis://:****@HOST:PORT/DB``), and a message that may quote it (another
library's error) goes through ``redact_text`` first.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

__all__ = [
    "DEFAULT_ARTIFACT",
    "DEFAULT_LOCAL",
    "DatabaseSpecError",
    "check_database",
    "open_database",
    "redact_text",
    "redact_url",
]

DEFAULT_LOCAL = ".hypothesis/examples"  # where Hypothesis keeps its own local database
DEFAULT_ARTIFACT = "hypothesis-example-db"  # GitHubArtifactDatabase's default artifact name

_GITHUB_OWNER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})")
_GITHUB_REPO = re.compile(r"[A-Za-z0-9._-]{1,100}")
# GitHub refuses these in artifact names.
_ARTIFACT_FORBIDDEN = set('":<>|*?\\/\r\n')


# A key no campaign saves under (campaign keys are hashed by Hypothesis).
_PROBE_KEY = b"tqbatch.testing.search.databases: can this database be read?"


class DatabaseSpecError(ValueError):
    """A ``--database`` spec that names no usable example database."""


MASK = "****"  # what a credential is shown as, as pip shows one
# A query parameter whose value is a credential: redis-py takes ``?password=``
# as the server's password, as it takes the one before the ``@``.
_SECRET_PARAM = re.compile(r"(?i)([?&](?:password|passwd|token|secret)=)([^&#]*)")
# Where a URL parser may cut a credential that holds one of these (a "/" in a
# password ends the host early): a message may quote any piece of it.
_CUTS = re.compile(r"[:/?#@]")


def redact_url(url: str) -> str:
    """``url`` as it may be shown: its password replaced by ``****``, as pip shows URLs.

    ``redis://:PW@host:6379/0`` is shown as ``redis://:****@host:6379/0`` and
    ``redis://user:PW@host/0`` as ``redis://user:****@host/0``; the value of a
    ``password=`` (or ``passwd``, ``token``, ``secret``) query parameter is
    masked too. A URL without a password (``redis://host/0``, and
    ``redis://user@host/0``: a username alone is kept), a directory and
    ``github:OWNER/REPO`` come back unchanged. Where the credentials of a URL
    do not end where a parser says its host begins (an ``@`` after the host,
    as a ``/`` in a password makes), everything between ``://`` and the last
    ``@`` is masked. Never raises.
    """
    return _redaction(url)[0]


def redact_text(text: str, url: str) -> str:
    """``text`` (a message that may quote ``url``) with no credential of ``url`` left in it.

    ``url`` itself becomes ``redact_url(url)``; a credential of it, whole,
    percent-decoded or any piece a parser may have cut it into (redis-py says
    "Port could not be cast to integer value as 'pa'" for a password
    ``pa/ss``), becomes ``****``. Masking a short piece may mask more of the
    text than the credential: what is shown may be less, never a secret.
    """
    redacted, secrets = _redaction(url)
    text = text.replace(url, redacted)
    pieces = {piece for s in secrets for piece in (s, unquote(s), *_CUTS.split(s)) if piece}
    for piece in sorted(pieces, key=len, reverse=True):  # a whole secret before its pieces
        text = text.replace(piece, MASK)
    return text


def _redaction(url: str) -> tuple[str, list[str]]:
    """``redact_url(url)``, and the credentials it masked (for ``redact_text``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, []
    secrets = [m[2] for m in _SECRET_PARAM.finditer(rest) if m[2]]
    rest = _SECRET_PARAM.sub(lambda m: m[1] + MASK, rest)
    if "@" not in rest:
        return f"{scheme}://{rest}", secrets
    try:
        netloc = urlsplit(f"{scheme}://{rest}").netloc
    except ValueError:  # an unclosed "[" of an IPv6 host: no netloc to trust
        netloc = None
    if netloc is None or not rest.startswith(netloc) or "@" in rest[len(netloc) :]:
        # The parser ended the host before an "@": all of it may be a password.
        userinfo, _, after = rest.rpartition("@")
        return f"{scheme}://{MASK}@{after}", [*secrets, userinfo]
    userinfo = netloc.rpartition("@")[0]
    user, colon, password = userinfo.partition(":")
    if not colon:
        return f"{scheme}://{rest}", secrets
    return f"{scheme}://{user}:{MASK}{rest[len(userinfo) :]}", [*secrets, password]


def open_database(spec: str, *, local: str | Path | None = None) -> ExampleDatabase:
    """The Hypothesis example database ``spec`` names (see the module docstring).

    ``local`` is the directory a ``github:`` spec multiplexes with the
    read-only artifact (default ``DEFAULT_LOCAL``); other specs ignore it.
    Nothing is connected to or downloaded here: ``check_database`` reads it
    once (a Redis server, the GitHub artifact).
    """
    spec = spec.strip() if isinstance(spec, str) else spec
    if not isinstance(spec, str) or not spec:
        raise DatabaseSpecError("--database needs a directory, a redis:// URL or github:OWNER/REPO")
    if spec.startswith("github:"):
        return _github(spec, local)
    scheme = spec.split("://", 1)[0].lower() if "://" in spec else None
    if scheme in ("redis", "rediss"):
        return _redis(spec)
    if scheme is not None:
        raise DatabaseSpecError(
            f"unknown database scheme {scheme}:// in {redact_url(spec)!r} "
            "(a directory, redis://HOST:PORT/DB or github:OWNER/REPO[/ARTIFACT])"
        )
    return _directory(spec)


def check_database(db: ExampleDatabase, spec: str) -> None:
    """Read ``db`` once now; raise ``DatabaseSpecError`` if it cannot be reached.

    Without this a campaign would fail only at its first read or save, deep
    inside Hypothesis (a Redis server that is down). The first read also
    fetches a GitHub artifact into Hypothesis's cache (for a day), so that
    shards started afterwards read the cached copy instead of each fetching
    it; one that cannot be fetched makes Hypothesis warn and read nothing
    from it. A directory is created on the first save.
    """
    try:
        for _ in db.fetch(_PROBE_KEY):
            pass
    except Exception as exc:  # noqa: BLE001 - redis raises many kinds; one line for the user
        raise _error(f"cannot read the database {redact_url(spec)}", exc, spec) from None


def _error(what: str, exc: Exception, spec: str) -> DatabaseSpecError:
    """``what`` went wrong, and why as ``exc`` says it, with no credential of ``spec``.

    Raised ``from None``: a traceback would also print ``exc`` itself, whose
    message may quote the password; this one has its type and its message
    redacted.
    """
    return DatabaseSpecError(f"{what}: {type(exc).__name__}: {redact_text(str(exc), spec)}")


def _directory(spec: str) -> ExampleDatabase:
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        raise DatabaseSpecError(f"--database {spec!r} is a file, not a directory")
    return DirectoryBasedExampleDatabase(path)


def _redis(spec: str) -> ExampleDatabase:
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError as exc:
        raise DatabaseSpecError(
            f"--database {redact_url(spec)} needs the redis package: pip install 'tqbatch[redis]'"
        ) from exc
    try:
        client = redis.Redis.from_url(spec)
    except ValueError as exc:  # redis-py's message for a malformed URL
        raise _error(f"bad Redis URL {redact_url(spec)!r}", exc, spec) from None
    return RedisExampleDatabase(client)


def _github(spec: str, local: str | Path | None) -> ExampleDatabase:
    parts = spec[len("github:") :].split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise DatabaseSpecError(f"bad GitHub database {spec!r}: github:OWNER/REPO[/ARTIFACT]")
    owner, repo = parts[:2]
    artifact = parts[2] if len(parts) == 3 else DEFAULT_ARTIFACT
    if not _GITHUB_OWNER.fullmatch(owner):
        raise DatabaseSpecError(f"bad GitHub owner {owner!r} in {spec!r}")
    if not _GITHUB_REPO.fullmatch(repo) or repo in (".", ".."):
        raise DatabaseSpecError(f"bad GitHub repository {repo!r} in {spec!r}")
    if _ARTIFACT_FORBIDDEN & set(artifact):
        raise DatabaseSpecError(f"bad GitHub artifact name {artifact!r} in {spec!r}")
    local_db = _directory(str(local if local is not None else DEFAULT_LOCAL))
    # GitHubArtifactDatabase cannot write (it raises on save): Hypothesis's
    # recipe wraps it read-only, and what this run finds goes to local_db.
    shared = ReadOnlyDatabase(GitHubArtifactDatabase(owner, repo, artifact_name=artifact))
    return MultiplexedDatabase(local_db, shared)
