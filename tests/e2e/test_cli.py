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
    impl = "tqbatch.testing.mutants:ExtractDropsLastToken"  # fails at any precision
    assert main(["e2e", "--impl", impl, "--layers", "2"]) == 1
    assert "FAILED: extract: request" in capsys.readouterr().out


def test_e2e_command_runs_an_mlx_lm_family_through_batch_generator(capsys):
    assert main(["e2e", "--family", "mlx-lm:llama"]) == 0
    out = capsys.readouterr().out
    assert "serving loop: mlx-lm's BatchGenerator" in out
    assert "OK: PASS" in out
    for uid in "ABCD":
        assert f"\n  {uid} " in out


def test_e2e_command_fails_an_mlx_lm_family_on_a_broken_cache(capsys):
    impl = "tqbatch.testing.mutants:ExtractDropsLastToken"  # BatchGenerator extracts on finish
    assert main(["e2e", "--family", "mlx-lm:llama", "--impl", impl]) == 1
    assert "FAILED: FAIL: layer 0 `ExtractDropsLastToken`, cache A finished with" in (
        capsys.readouterr().out
    )


def test_models_command_prints_the_matrix_and_passes_on_tqbatch(capsys):
    args = ["models", "--families", "qwen2", "--scenarios", "prefill_decode", "speculative"]
    assert main([*args, "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| family | scenario | tqbatch | BatchKVCache |" in out
    assert "| qwen2 | speculative | PASS | PASS |" in out


def test_models_command_fails_where_batchkvcache_passes(capsys):
    impl = "tqbatch.testing.mutants:HandWrittenMaskHidesLeftPadded"
    args = ["models", "--impl", impl, "--families", "llama", "--scenarios", "prefill_decode"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "attention output differs" in captured.out
    assert "where BatchKVCache passes" in captured.err


BAD_TARGET = [
    ["e2e", "--impl", "nope:Nope"],
    ["fuzz", "--impl", "nope:Nope", "--examples", "1"],
    ["bench", "--impl", "nope:Nope"],
    ["models", "--impl", "nope:Nope"],
    ["conformance", "nope:Nope"],
    ["replay", "--impl", "nope:Nope", "tqbatch/testing/replay/golden/21_no_idx_attribute.json"],
    ["record", "--impl", "nope:Nope", "tqbatch/testing/replay/golden/21_no_idx_attribute.json"],
]


def test_every_command_reports_a_bad_target_in_one_line(capsys):
    """The same one-line error and exit code 2 for a target that does not load, everywhere."""
    for argv in BAD_TARGET:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [
            f"tqbatch {argv[0]}: implementation 'nope:Nope' (from argument): cannot import "
            "module 'nope': No module named 'nope'"
        ], argv
