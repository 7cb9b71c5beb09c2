"""The CLI frame: sub-command discovery and exit codes (no MLX work)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tqbatch.commands
from tqbatch import cli

_FAKE_COMMAND = textwrap.dedent(
    """
    def register(subparsers):
        p = subparsers.add_parser("zzfake", help="test command")
        p.add_argument("--code", type=int, default=0)
        p.set_defaults(func=run)

    def run(args):
        return args.code
    """
)


@pytest.fixture
def fake_command(tmp_path, monkeypatch):
    """A throwaway command module placed on the commands package's search path."""
    (tmp_path / "zzfake.py").write_text(_FAKE_COMMAND)
    (tmp_path / "_zzhelper.py").write_text("raise AssertionError('helpers must not be imported')\n")
    monkeypatch.setattr(tqbatch.commands, "__path__", [*tqbatch.commands.__path__, str(tmp_path)])
    yield
    for name in ("tqbatch.commands.zzfake", "tqbatch.commands._zzhelper"):
        sys.modules.pop(name, None)


def test_discovered_command_runs_and_its_exit_code_is_returned(fake_command):
    assert cli.main(["zzfake"]) == 0
    assert cli.main(["zzfake", "--code", "3"]) == 3


def test_helpers_are_not_commands(fake_command):
    names = [m.__name__ for m in cli.command_modules()]
    assert "tqbatch.commands.zzfake" in names
    assert not any(n.rsplit(".", 1)[1].startswith("_") for n in names)


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: tqbatch" in capsys.readouterr().err


def test_python_dash_m_exits_with_the_command_code():
    """``python -m tqbatch`` must hand the parse error's code to the shell."""
    done = subprocess.run(
        [sys.executable, "-m", "tqbatch", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
