"""``--database SPEC``: which Hypothesis example database each spec opens, and bad specs.

Nothing here reaches a network: a GitHub artifact is fetched only on the
first read, and a Redis client connects only on its first command (the real
Redis server is tests/e2e/test_shared_database.py's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

from tqbatch.testing.search.databases import (
    DEFAULT_ARTIFACT,
    DEFAULT_LOCAL,
    DatabaseSpecError,
    check_database,
    open_database,
)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths (the default local directory) land here


def test_a_path_is_a_directory_database(tmp_path):
    db = open_database(str(tmp_path / "shared"))
    assert isinstance(db, DirectoryBasedExampleDatabase)
    assert Path(db.path) == tmp_path / "shared"
    db.save(b"key", b"value")  # created on the first save
    assert list(db.fetch(b"key")) == [b"value"]


def test_a_redis_url_is_a_redis_database():
    pytest.importorskip("redis")  # the `redis` extra, part of `test`
    from hypothesis.extra.redis import RedisExampleDatabase

    db = open_database("redis://db.example:6390/3")
    assert isinstance(db, RedisExampleDatabase)
    kwargs = db.redis.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("db.example", 6390, 3)


def test_a_github_spec_is_the_artifact_read_only_with_a_local_directory(tmp_path):
    db = open_database("github:octo-org/tq.batch")
    assert isinstance(db, MultiplexedDatabase)
    local, shared = db._wrapped
    assert isinstance(local, DirectoryBasedExampleDatabase)
    assert Path(local.path) == Path(DEFAULT_LOCAL)
    assert isinstance(shared, ReadOnlyDatabase)
    artifact = shared._wrapped
    assert isinstance(artifact, GitHubArtifactDatabase)
    assert (artifact.owner, artifact.repo, artifact.artifact_name) == (
        "octo-org",
        "tq.batch",
        DEFAULT_ARTIFACT,
    )
    # What this run finds goes to the local directory; the artifact is never written.
    shared.save(b"key", b"value")
    shared.delete(b"key", b"value")

    named = open_database("github:octo/repo/fuzz-db-linux", local=tmp_path / "mine")
    local, shared = named._wrapped
    assert Path(local.path) == tmp_path / "mine"
    assert shared._wrapped.artifact_name == "fuzz-db-linux"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("", "needs a directory"),
        ("   ", "needs a directory"),
        ("ftp://host/x", "unknown database scheme ftp://"),
        ("github:", "github:OWNER/REPO"),
        ("github:owner", "github:OWNER/REPO"),
        ("github:owner/", "github:OWNER/REPO"),
        ("github:a/b/c/d", "github:OWNER/REPO"),
        ("github:-owner/repo", "bad GitHub owner"),
        ("github:owner/re po", "bad GitHub repository"),
        ("github:owner/..", "bad GitHub repository"),
        ("github:owner/repo/a:b", "bad GitHub artifact name"),
        ("redis://host:notaport/0", "bad Redis URL"),
    ],
)
def test_a_bad_spec_says_what_is_wrong(spec, words):
    if spec.startswith("redis"):
        pytest.importorskip("redis")
    with pytest.raises(DatabaseSpecError, match=words) as raised:
        open_database(spec)
    assert "\n" not in str(raised.value)  # one line, for the CLI's usage error


def test_a_file_is_not_a_directory_database(tmp_path):
    (tmp_path / "plain").write_text("")
    with pytest.raises(DatabaseSpecError, match="is a file"):
        open_database(str(tmp_path / "plain"))


def test_an_unreachable_redis_server_is_one_line():
    pytest.importorskip("redis")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(DatabaseSpecError, match="cannot read the database") as raised:
        check_database(open_database(spec), spec)
    assert "\n" not in str(raised.value)
