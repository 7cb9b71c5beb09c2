"""A ``--database`` URL's password is used, and shown nowhere.

- ``redact_url`` masks a URL's password as pip does; ``redact_text`` masks
  one in a message, whole or in the pieces a parser may cut it into.
- ``open_database`` and ``check_database`` name the URL redacted, also where
  the message is another library's (redis-py's).
- ``tqbatch fuzz --database URL`` shows the password nowhere: not on stdout
  or stderr, in the job summary, the JUnit XML nor a saved scenario, whether
  the database cannot be reached (port 1: nothing listens) or a campaign
  runs against it and finds a failure. Nor does the ``$GITHUB_TOKEN`` a
  ``github:`` database is read with appear.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from hypothesis.database import InMemoryExampleDatabase

from tqbatch import cli
from tqbatch.exitcodes import ExitCode
from tqbatch.testing.search import databases
from tqbatch.testing.search.databases import (
    DatabaseSpecError,
    open_database,
    redact_text,
    redact_url,
)

PASSWORD = "s3cr3t-PASS"
URL = f"redis://:{PASSWORD}@127.0.0.1:1/0"  # port 1: nothing listens, it fails fast
SHOWN = "redis://:****@127.0.0.1:1/0"
# Fails its first check (size() is an array): a failure in the first example.
MUTANT = "tqbatch.testing.mutants:SizeAsArray"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a run writes by default lands here


# ---------------------------------------------------------------- the functions


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:PW@host:6379/0", "redis://:****@host:6379/0"),
        ("redis://user:PW@host/0", "redis://user:****@host/0"),
        ("rediss://user:p%40ss@host/0", "rediss://user:****@host/0"),
        ("redis://user:@host/0", "redis://user:****@host/0"),
        ("redis://:p@ss@host/0", "redis://:****@host/0"),  # the last "@" ends it
        ("redis://host/0?password=PW&db=1", "redis://host/0?password=****&db=1"),
        # Unchanged: no password.
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("redis://user@host/0", "redis://user@host/0"),
        ("/srv/shared/examples", "/srv/shared/examples"),
        ("github:octo-org/repo", "github:octo-org/repo"),
        ("", ""),
        # Malformed: a "/" in a password ends the host early, an IPv6 host is
        # not closed. All between "://" and the last "@" is masked.
        ("redis://:pa/ss@host:1/0", "redis://****@host:1/0"),
        ("redis://u:pw@[::1/0", "redis://****@[::1/0"),
        ("://@", "://****@"),
    ],
)
def test_redact_url_masks_a_password_as_pip_does(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("text", "url", "shown"),
    [
        (f"cannot reach {URL}", URL, f"cannot reach {SHOWN}"),
        ("auth failed for 'p@ss'", "redis://:p%40ss@host/0", "auth failed for '****'"),
        # redis-py's message for this URL quotes a piece of the password.
        (
            "Port could not be cast to integer value as 'pa'",
            "redis://:pa/ss@host:1/0",
            "Port could not be cast to integer value as '****'",
        ),
        ("nothing secret here", "redis://user@host/0", "nothing secret here"),
    ],
)
def test_redact_text_masks_a_password_and_its_pieces(text, url, shown):
    assert redact_text(text, url) == shown


# ---------------------------------------------------------------- the database errors


@pytest.mark.parametrize(
    "spec",
    [
        "http://user:s3cr3t-PASS@host/x",  # an unknown scheme
        "redis://:s3cr3t/PASS@host:1/0",  # redis-py reads "s3cr3t" as the port
    ],
)
def test_a_bad_url_is_named_without_its_password(spec):
    pytest.importorskip("redis")
    with pytest.raises(DatabaseSpecError) as raised:
        open_database(spec)
    message = str(raised.value)
    assert "s3cr3t" not in message and "PASS" not in message, message
    assert "****" in message
    _no_cause_shown(raised.value)


def test_an_unreachable_server_is_named_without_its_password():
    pytest.importorskip("redis")
    with pytest.raises(DatabaseSpecError) as raised:
        databases.check_database(open_database(URL), URL)
    message = str(raised.value)
    assert PASSWORD not in message
    assert message.startswith(f"cannot read the database {SHOWN}: ConnectionError: "), message
    _no_cause_shown(raised.value)


def _no_cause_shown(error: BaseException) -> None:
    """A traceback of ``error`` shows no other exception, whose message could quote a password."""
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__


# ---------------------------------------------------------------- tqbatch fuzz


def _everything_written(tmp_path) -> str:
    """Every file under ``tmp_path``, as text: the summary, the report, the scenarios."""
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    return "\n".join(p.read_text(errors="replace") for p in files)


def test_fuzz_shows_no_password_of_a_database_it_cannot_reach(tmp_path):
    pytest.importorskip("redis")
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(tmp_path / "summary.md"))
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    run = subprocess.run(
        [sys.executable, "-m", "tqbatch", "fuzz", "--database", URL, "--examples", "1",
         "--profile", "ci", "--out", "failures", "--junit-xml", "report.xml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == ExitCode.USAGE, run.stdout + run.stderr
    assert PASSWORD not in run.stdout + run.stderr
    assert PASSWORD not in _everything_written(tmp_path)
    assert f"tqbatch fuzz: cannot read the database {SHOWN}: " in run.stderr


@pytest.fixture
def reachable(monkeypatch):
    """Redis URLs open an in-memory database: a campaign runs against "the server"."""
    pytest.importorskip("redis")
    opened = []

    def in_memory(spec):
        opened.append(spec)
        return InMemoryExampleDatabase()

    monkeypatch.setattr(databases, "_redis", in_memory)
    return opened


@pytest.fixture
def summary(tmp_path, monkeypatch):
    path = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(path))
    return path


def test_fuzz_shows_no_password_of_a_database_it_ran_against(tmp_path, reachable, summary, capsys):
    args = ["fuzz", "--impl", MUTANT, "--database", URL, "--examples", "1", "--profile", "ci",
            "--out", "failures", "--junit-xml", "report.xml"]  # fmt: skip
    assert cli.main(args) == ExitCode.DEFECT
    assert reachable == [URL]  # opened with the password
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err
    assert PASSWORD not in _everything_written(tmp_path)
    # Each names the database, redacted.
    assert SHOWN in out
    assert SHOWN in summary.read_text()
    assert f'name="option.database" value="{SHOWN}"' in (tmp_path / "report.xml").read_text()
    (saved,) = (tmp_path / "failures").glob("*.json")
    assert json.loads(saved.read_text())["found_on"]["options"]["database"] == SHOWN


def test_replaying_nothing_shows_no_password(tmp_path, reachable, summary, capsys):
    args = ["fuzz", "--database", URL, "--replay-only", "--profile", "ci",
            "--junit-xml", "report.xml"]  # fmt: skip
    assert cli.main(args) == ExitCode.NOTHING_CHECKED
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err
    assert PASSWORD not in _everything_written(tmp_path)
    assert f"nothing was checked: {SHOWN} holds no saved example" in " ".join(err.split())


def test_fuzz_shows_no_github_token(tmp_path, summary, monkeypatch, capsys, recwarn):
    token = "ghp_" + "T0KEN" * 8
    monkeypatch.setenv("GITHUB_TOKEN", token)
    sent = []

    def refused(request, *args, **kwargs):  # GitHub says the token is not good
        sent.append(request.get_header("Authorization"))
        raise urllib.error.HTTPError(request.full_url, 401, "Unauthorized", {}, io.BytesIO())

    monkeypatch.setattr(urllib.request, "urlopen", refused)
    args = ["fuzz", "--impl", MUTANT, "--database", "github:octo-org/repo",
            "--database-local", "local-db", "--examples", "1", "--profile", "ci",
            "--out", "failures", "--junit-xml", "report.xml"]  # fmt: skip
    assert cli.main(args) == ExitCode.DEFECT
    assert sent == [f"Bearer {token}"]  # the artifact was asked for with the token
    out, err = capsys.readouterr()
    assert token not in out + err
    assert token not in _everything_written(tmp_path)
    assert not [w for w in recwarn if token in str(w.message)]


def test_shards_that_did_not_run_show_no_password(monkeypatch):
    from tqbatch.testing.search import shards

    class Failed:
        """A pytest-xdist run that ended in a usage error, its traceback quoting the options."""

        returncode = 4
        stdout = io.BytesIO(f"options = {{'database': {URL!r}}}\n".encode())

        def __init__(self, *args, **kwargs):
            pass

        def poll(self):
            return self.returncode

    monkeypatch.setattr(shards.subprocess, "Popen", Failed)
    options = {"examples": 2, "workers": 2, "database": URL}
    with pytest.raises(RuntimeError, match="did not run") as raised:
        shards.run_shards(options, lambda n: None)
    assert PASSWORD not in str(raised.value) and SHOWN in str(raised.value)
