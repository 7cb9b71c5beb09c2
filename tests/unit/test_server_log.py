"""server_log: which cache served which request, read from a server's log in order."""

from __future__ import annotations

from tqbatch.workbench.server_log import read_batch_log

TQ = "tqbatch.cache.BatchTurboQuantKVCache"
DENSE = "mlx_vlm.models.cache.BatchKVCache"


def _prefill(request: str, tokens: int) -> str:
    return (
        f"2026-12-06 17:25:16,603 - INFO - Prefill started: request={request} "
        f"backend=continuous_batching prompt_tokens={tokens} images=0"
    )


def _done(request: str) -> str:
    return (
        f"2026-12-06 17:25:16,676 - INFO - Decode completed: request={request} generated_tokens=8"
    )


def _serve(message: str) -> str:
    return f"2026-12-06 17:25:16,610 - INFO - tqbatch serve: {message}"


def test_a_batch_serves_the_requests_whose_prefill_started_last():
    log = read_batch_log(
        "\n".join(
            [
                _prefill("a", 10),
                _serve(f"batch of 1 rows on {DENSE}"),
                _prefill("b", 20),
                _prefill("c", 30),
                _serve(f"batch of 2 rows on {TQ}"),
            ]
        )
    )
    assert log.classes_of(10) == ("mlx_vlm.BatchKVCache",)
    assert log.classes_of(20) == log.classes_of(30) == ("tqbatch.BatchTurboQuantKVCache",)
    assert log.batch_rows == [1, 2]
    assert log.most_in_flight == 3
    assert log.shared()


def test_a_join_serves_every_request_still_decoding():
    log = read_batch_log(
        "\n".join(
            [
                _prefill("a", 10),
                _serve(f"batch of 1 rows on {DENSE}"),
                _prefill("b", 20),
                _done("a"),
                _serve(f"batch of 1 rows on {TQ}"),
                _serve(f"join: {DENSE} + {TQ} -> {TQ}"),
            ]
        )
    )
    assert log.classes_of(10) == ("mlx_vlm.BatchKVCache",)  # it left before the join
    assert log.classes_of(20) == ("tqbatch.BatchTurboQuantKVCache",)
    assert log.joins == 1 and log.shared()


def test_a_failed_join_is_recorded_with_what_it_raised():
    failure = (
        f"{DENSE} + {TQ}: AttributeError: 'TurboQuantMSEState' object has no attribute 'shape'"
    )
    log = read_batch_log(_serve(f"join failed: {failure}"))
    assert log.failed_joins == [failure]
    assert log.joins == 0


def test_without_per_request_lines_a_batch_serves_every_request():
    """A batch line that names no prompts, and no request started: the whole phase's."""
    log = read_batch_log("\n".join([_serve(f"batch of 4 rows on {TQ}")]))
    assert log.classes_of(14) == ("tqbatch.BatchTurboQuantKVCache",)
    assert log.shared()


def test_a_batch_line_naming_its_prompts_serves_those_requests():
    """mlx-lm's server logs no line per request: tqbatch serve names the rows' prompts."""
    mlx_lm_dense = "mlx_lm.models.cache.BatchKVCache"
    log = read_batch_log(
        "\n".join(
            [
                _serve(f"batch of 2 rows on {TQ}, prompts of 14, 75 tokens"),
                _serve(f"batch of 1 rows on {mlx_lm_dense}, prompts of 30 tokens"),
                _serve(f"join: {TQ} + {mlx_lm_dense} -> {TQ}"),
            ]
        )
    )
    assert log.classes_of(14) == log.classes_of(75) == ("tqbatch.BatchTurboQuantKVCache",)
    # No line says a request ended: the join serves every request batched before it.
    assert log.classes_of(30) == ("mlx_lm.BatchKVCache", "tqbatch.BatchTurboQuantKVCache")
    assert log.classes_of(99) == ()
    assert log.batch_rows == [2, 1]
    assert log.most_in_flight == 0  # nothing says when a request ended


def test_one_request_alone_shares_nothing():
    log = read_batch_log(
        "\n".join([_prefill("a", 10), _serve(f"batch of 1 rows on {TQ}"), _done("a")])
    )
    assert not log.shared()
