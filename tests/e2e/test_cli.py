"""``tqbatch e2e`` prints the oracle's verdict and reports it through its exit code."""

from __future__ import annotations

from tqbatch.cli import main


def test_e2e_command_passes_on_tqbatch(capsys):
    # Two layers (one TurboQuant, one dense) keep the command's test cheap.
    assert main(["e2e", "--impl", "tqbatch:BatchTurboQuantKVCache", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: every request's rows, attention and extracted caches match" in out
    assert "cache oracle (the verdict)" in out
    assert "model level (a report, not a verdict)" in out
    assert "head_dim 64" in out


def test_e2e_command_fails_on_a_broken_cache(capsys):
    impl = "tqbatch.testing.mutants:FinalizeRequantizes"
    assert main(["e2e", "--impl", impl, "--layers", "2"]) == 1
    assert "FAILED: content: request" in capsys.readouterr().out
