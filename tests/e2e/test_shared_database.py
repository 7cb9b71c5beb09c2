"""Campaigns in separate processes share what they find through one real Redis server.

A fixture starts ``redis-server`` (the Debian/Ubuntu package ``redis-server``)
on a free loopback port, with no persistence, and stops it after. Then, as a
user runs them, ``tqbatch fuzz`` campaigns against that one database: the
first finds a planted bug and Hypothesis saves it there; later campaigns,
with other seeds, replay it before generating anything (``--replay-only``,
a plain run, a run over two pytest-xdist workers); a campaign against
another target replays none of it. What each run replayed is read from its
``--junit-xml`` report.

Without ``redis-server`` the test fails where ``$CI`` is set (CI must run
it), and is skipped with the reason at a desk.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

# Fails its first check (size() is an array): found in the first example,
# whatever the seed, and shrunk within a second.
MUTANT = "tqbatch.testing.mutants:SizeAsArray"
IDENTITY = "size_type"


def _unavailable(why: str):
    if os.environ.get("CI"):
        pytest.fail(f"{why}: CI must run the shared-database test", pytrace=False)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    """``redis://127.0.0.1:PORT/0`` of a ``redis-server`` of this test's own, stopped after."""
    exe = shutil.which("redis-server")
    if exe is None:
        _unavailable("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
    try:
        import redis
    except ImportError:
        _unavailable("the redis package is not installed (pip install 'tqbatch[redis]')")
    port = _free_port()
    # --save '' and --appendonly no: nothing written to disk; --dir: in case.
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    output = proc.communicate()[0].decode(errors="replace")
                    pytest.fail(f"redis-server did not start on port {port}:\n{output}")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _fuzz(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tqbatch", "fuzz", "--profile", "ci", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _report(path) -> tuple[dict, list[dict]]:
    """The suite's counts and, per testcase, its name, properties and outcome."""
    suite = ET.parse(path).getroot().find("testsuite")
    counts = {p.get("name"): p.get("value") for p in suite.find("properties")}
    cases = []
    for case in suite.findall("testcase"):
        props = case.find("properties")
        cases.append(
            {
                "name": case.get("name"),
                "failed": case.find("failure") is not None,
                "skipped": case.find("skipped") is not None,
                **({p.get("name"): p.get("value") for p in props} if props is not None else {}),
            }
        )
    return counts, cases


def test_campaigns_share_finds_through_redis(redis_url, tmp_path):
    # 1. The first campaign finds the bug by generating, and saves it to Redis.
    first = _fuzz("--impl", MUTANT, "--database", redis_url, "--examples", "5", "--seed", "1",
                  "--junit-xml", "first.xml", cwd=tmp_path)  # fmt: skip
    assert first.returncode == 1, first.stdout + first.stderr
    counts, cases = _report(tmp_path / "first.xml")
    assert counts["replayed"] == "0" and int(counts["examples"]) >= 1
    assert [(c["name"], c["failed"], c["replayed"]) for c in cases] == [(IDENTITY, True, "false")]

    # 2. Another process, another seed, replaying only: the same failure, replayed.
    replay = _fuzz("--impl", MUTANT, "--database", redis_url, "--replay-only", "--seed", "2",
                   "--junit-xml", "replay.xml", cwd=tmp_path)  # fmt: skip
    assert replay.returncode == 1, replay.stdout + replay.stderr
    counts, cases = _report(tmp_path / "replay.xml")
    assert int(counts["replayed"]) >= 1 and counts["examples"] == "0", counts
    assert [(c["name"], c["failed"], c["replayed"]) for c in cases] == [(IDENTITY, True, "true")]
    assert "replayed from the database" in replay.stdout

    # 3. A normal campaign over two workers (each opens the database): every
    # shard replays the find before it generates anything, so it is found
    # while replaying and nothing was generated.
    sharded = _fuzz("--impl", MUTANT, "--database", redis_url, "--examples", "4", "--seed", "3",
                    "--workers", "2", "--junit-xml", "sharded.xml", cwd=tmp_path)  # fmt: skip
    assert sharded.returncode == 1, sharded.stdout + sharded.stderr
    counts, cases = _report(tmp_path / "sharded.xml")
    assert int(counts["replayed"]) >= 2 and counts["examples"] == "0", counts
    assert [(c["name"], c["failed"], c["replayed"]) for c in cases] == [(IDENTITY, True, "true")]

    # 4. Another target (tqbatch's own cache) against the same database reads
    # its own key: it replays none of the mutant's examples...
    clean = _fuzz("--database", redis_url, "--examples", "2", "--seed", "4",
                  "--junit-xml", "clean.xml", cwd=tmp_path)  # fmt: skip
    assert clean.returncode == 0, clean.stdout + clean.stderr
    counts, cases = _report(tmp_path / "clean.xml")
    assert counts["replayed"] == "0" and counts["examples"] == "2"
    assert [(c["name"], c["failed"]) for c in cases] == [("campaign", False)]
    # ...and replaying only, it checks nothing (exit 5)...
    nothing = _fuzz("--database", redis_url, "--replay-only", "--junit-xml", "nothing.xml",
                    cwd=tmp_path)  # fmt: skip
    assert nothing.returncode == 5, nothing.stdout + nothing.stderr
    assert "nothing was checked" in nothing.stderr
    _, cases = _report(tmp_path / "nothing.xml")
    assert [(c["name"], c["skipped"]) for c in cases] == [("campaign", True)]

    # ...while the mutant's find is still there for the next campaign against it.
    again = _fuzz("--impl", MUTANT, "--database", redis_url, "--replay-only",
                  "--junit-xml", "again.xml", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 1, again.stdout + again.stderr
    assert _report(tmp_path / "again.xml")[1][0]["replayed"] == "true"
