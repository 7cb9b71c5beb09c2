"""``tqbatch e2e`` runs the scenario and reports through its exit code."""

from __future__ import annotations

from tqbatch.cli import main


def test_e2e_command_passes_on_tqbatch(capsys):
    assert main(["e2e", "--impl", "tqbatch:BatchTurboQuantKVCache"]) == 0
    out = capsys.readouterr().out
    assert "OK: every request matches" in out
    assert "head_dim 64" in out


def test_e2e_command_fails_on_a_broken_cache(capsys):
    assert main(["e2e", "--impl", "tqbatch.testing.mutants:FinalizeRequantizes"]) == 1
    assert "FAILED: request" in capsys.readouterr().out
