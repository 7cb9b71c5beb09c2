"""The HTTP server oracle's table: one row per request, each verdict explained where it can be.

A request's batched reply that differs from its alone reply is the cache's
failure unless the server explains it:

* ``precision``: the server quantized the request in the batch and not alone
  (mlx-vlm's ``--quantized-kv-start`` decides per prefill group: a short
  request joined by a long one is quantized with it);
* the baseline: the same request differs on the same server with no
  quantization (``BatchKVCache``), so the server changes it whatever the cache.

``unexplained`` lists the rows of the caches under test (tqbatch's class or a
subclass) that fail with neither reason; a scenario whose requests never
shared a batch checked nothing, and is listed too.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqbatch.workbench.http_oracle import LoadResult, ScenarioResult, Verdict

__all__ = [
    "COLUMNS",
    "LOAD_COLUMNS",
    "explanation",
    "load_problems",
    "render",
    "render_load",
    "render_summary",
    "rows",
    "unexplained",
]

COLUMNS = (
    "server",
    "cache",
    "scenario",
    "request",
    "prompt tokens",
    "verdict",
    "first difference",
    "max logprob gap",
    "served by (batched / alone)",
    "why",
)
UNDER_TEST = "tqbatch"


def _baseline(
    results: Sequence[ScenarioResult], result: ScenarioResult, verdict: Verdict
) -> Verdict | None:
    """``verdict``'s request in the same scenario on the same server with no quantization."""
    for other in results:
        if (
            other.launch.cache == "BatchKVCache"
            and other.launch.server == result.launch.server
            and other.scenario.name == result.scenario.name
        ):
            for theirs in other.verdicts:
                if theirs.request == verdict.request:
                    return theirs
    return None


def explanation(results: Sequence[ScenarioResult], result: ScenarioResult, verdict: Verdict) -> str:
    """Why ``verdict`` is the server's (see the module docstring), or "" where nothing says so."""
    if verdict.status == "PASS" or not verdict.request.judged:
        return ""
    if verdict.precision_differs():
        return "precision: quantized batched, full precision alone (the server's per-group choice)"
    baseline = _baseline(results, result, verdict)
    if baseline is not None and baseline.status != "PASS":
        return "the server's: it differs with no quantization too (BatchKVCache)"
    return ""


def _prompt(verdict: Verdict) -> str:
    """Prompt tokens, with those the server took from its prefix cache in parentheses."""
    if verdict.prompt_tokens is None:
        return ""
    cached = verdict.batched.cached_tokens
    return f"{verdict.prompt_tokens} ({cached} cached)" if cached else str(verdict.prompt_tokens)


def _served(verdict: Verdict) -> str:
    return f"{', '.join(verdict.served_by) or '?'} / {', '.join(verdict.served_alone_by) or '?'}"


def rows(results: Sequence[ScenarioResult]) -> list[tuple[str, ...]]:
    """The table's rows, in the order the results ran."""
    table = []
    for result in results:
        for v in result.verdicts:
            gap = "" if v.logprob_gap is None else f"{v.logprob_gap:.1e}"
            first = "" if v.first_difference is None else str(v.first_difference)
            why = explanation(results, result, v) or v.detail()
            table.append(
                (
                    result.launch.server,
                    result.launch.impl or result.launch.cache,
                    result.scenario.name,
                    v.request.name,
                    _prompt(v),
                    v.status,
                    first,
                    gap,
                    _served(v),
                    why,
                )
            )
    return table


def unexplained(results: Sequence[ScenarioResult]) -> list[str]:
    """What fails the run: requests of the caches under test failing with no server reason,
    and scenarios whose requests never shared a batch."""
    problems = []
    for result in results:
        if result.launch.cache != UNDER_TEST:
            continue
        where = f"{result.launch.label}, {result.scenario.name}"
        if result.scenario.batches and not result.batch_log.shared():
            problems.append(f"{where}: the requests never shared a batch (nothing was checked)")
        for v in result.verdicts:
            if v.request.judged and v.status != "PASS" and not explanation(results, result, v):
                problems.append(f"{where}, {v.request.name}: {v.status} {v.detail()}")
    return problems


SUMMARY_COLUMNS = (
    "server",
    "cache",
    "scenario",
    "equal to alone",
    "differ: the server's",
    "differ: unexplained",
    "HTTP errors",
    "shared a batch",
)


def render_summary(results: Sequence[ScenarioResult], *, markdown: bool) -> str:
    """One row per server, cache and scenario: its judged requests counted by verdict."""
    table = []
    for result in results:
        judged = [v for v in result.verdicts if v.request.judged]
        differ = [v for v in judged if v.status == "FAIL"]
        explained = [v for v in differ if explanation(results, result, v)]
        table.append(
            (
                result.launch.server,
                result.launch.impl or result.launch.cache,
                result.scenario.name,
                f"{sum(v.status == 'PASS' for v in judged)}/{len(judged)}",
                str(len(explained)),
                str(len(differ) - len(explained)),
                str(sum(v.status == "ERROR" for v in judged)),
                ("yes" if result.batch_log.shared() else "no")
                + ("" if result.scenario.batches else " (one at a time)"),
            )
        )
    return _table(SUMMARY_COLUMNS, table, markdown=markdown)


def render(results: Sequence[ScenarioResult], *, markdown: bool) -> str:
    """The per-request table as markdown or as aligned text."""
    return _table(COLUMNS, rows(results), markdown=markdown)


LOAD_COLUMNS = (
    "server",
    "cache",
    "requests (at once)",
    "equal to alone",
    "most rows decoding together",
    "tokens/s",
    "peak server RSS (MiB)",
)


def load_problems(results: Sequence[LoadResult]) -> list[str]:
    """What fails a load run of the caches under test: any reply unlike its alone run."""
    return [
        f"{r.launch.label}, load: {v.request.name}: {v.status} {v.detail()}"
        for r in results
        if r.launch.cache == UNDER_TEST
        for v in r.verdicts
        if v.status != "PASS"
    ]


def _table(columns: Sequence[str], table: Sequence[Sequence[str]], *, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table]
        return "\n".join(lines)
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*columns), *(fmt.format(*row) for row in table)])


def render_load(results: Sequence[LoadResult], *, markdown: bool) -> str:
    """The load runs, one row per server and cache."""
    table = []
    for r in results:
        passed = sum(v.status == "PASS" for v in r.verdicts)
        rss = "" if r.peak_rss_bytes is None else f"{r.peak_rss_bytes / 2**20:.0f}"
        most = max([r.batch_log.most_in_flight, *r.batch_log.batch_rows], default=0)
        table.append(
            (
                r.launch.server,
                r.launch.impl or r.launch.cache,
                f"{r.requests} ({r.concurrency})",
                f"{passed}/{len(r.verdicts)}",
                str(most),
                f"{r.tokens_per_second:.0f}",
                rss,
            )
        )
    return _table(LOAD_COLUMNS, table, markdown=markdown)
