"""The HTTP server oracle: every response of a batch against the same request sent alone.

A scenario's requests go to a real server process (``server_process``)
together, as concurrent chat completions with greedy decoding; late ones are
sent once the server's log shows the first batch built, so they join a
running batch. Then each request is sent again, alone, to the same server.
Each batched response must equal its alone run token for token; where both
return log-probabilities, the largest difference over the shared tokens is
reported beside the verdict (not judged: a batched forward is not bit-equal
to the request alone, and that is the model's float rounding, not the cache's).
The server's log says which cache classes served each request and whether the
requests really shared a batch (``server_log``).

Verdicts: PASS (the same tokens), FAIL (another token; the first differing
position is reported), ERROR (the batched request got no answer: an HTTP
error, as mlx-vlm's class gives when a full-precision group and a TurboQuant
one meet).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tqbatch.workbench.local_model import WORDS, write_model_dir
from tqbatch.workbench.server_log import BatchLog, read_batch_log
from tqbatch.workbench.server_process import Launch, ServerFailed, running

__all__ = [
    "SCENARIOS",
    "LoadResult",
    "Reply",
    "Request",
    "Scenario",
    "ScenarioResult",
    "Verdict",
    "chat",
    "load_requests",
    "run_load",
    "run_scenario",
]

REQUEST_SECONDS = 120.0
# How long a late request waits for the first batch to be built, and what says it was.
LATE_WAIT_SECONDS = 30.0
BATCH_BUILT = "tqbatch serve: batch of"
# First words of the vocabulary are punctuation and digits; prompts use words.
_PROMPT_WORDS = [w for w in WORDS if w.isalpha()]


@dataclass(frozen=True)
class Request:
    """One chat request: a prompt of ``words`` words drawn from ``seed``, greedy decoding.

    ``follows``: the name of a scenario's earlier turn; the request is that
    turn's prompt and reply, then its own prompt (a conversation going on,
    whose prefix a server can reuse). ``disconnect_after``: the request
    streams and its client hangs up after that many chunks (it gets no
    verdict; the others must not notice). ``malformed``: its body is not a
    valid request (the server must refuse it and go on).
    """

    name: str
    words: int
    max_tokens: int = 24
    late: bool = False
    seed: int = 0
    follows: str | None = None
    disconnect_after: int | None = None
    malformed: bool = False

    @property
    def judged(self) -> bool:
        """Whether its batched reply is compared with an alone run."""
        return self.disconnect_after is None and not self.malformed

    def prompt(self) -> str:
        rng = np.random.default_rng([self.seed, self.words])
        return " ".join(rng.choice(_PROMPT_WORDS, size=self.words).tolist())

    def body(self, model: str, history: Sequence[dict] = ()) -> dict:
        messages = [*history, {"role": "user", "content": self.prompt()}]
        return {
            "model": model,
            # A malformed request: a message without its content.
            "messages": [{"role": "user"}] if self.malformed else messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "stream": self.disconnect_after is not None,
        }


@dataclass(frozen=True)
class Reply:
    """A server's answer to one request: its tokens and their log-probabilities, or its error."""

    status: int
    tokens: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache
    text: str = ""
    error: str | None = None


def _post(base: str, body: dict):
    http = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(http, timeout=REQUEST_SECONDS)


def chat(base: str, model: str, request: Request, history: Sequence[dict] = ()) -> Reply:
    """POST ``request`` to ``base``'s chat completions; the reply, or the HTTP error as one.

    A request that disconnects reads that many lines of its stream, then closes.
    """
    try:
        with _post(base, request.body(model, history)) as response:
            if request.disconnect_after is not None:
                for _ in range(request.disconnect_after):
                    response.readline()
                return Reply(status=response.status, error="disconnected")
            payload = json.load(response)
    except urllib.error.HTTPError as exc:
        return Reply(status=exc.code, error=exc.read().decode(errors="replace")[:300])
    except (urllib.error.URLError, OSError) as exc:
        return Reply(status=0, error=f"{type(exc).__name__}: {exc}")
    choice = payload["choices"][0]
    content = choice["logprobs"]["content"]
    usage = payload["usage"]
    return Reply(
        status=200,
        # mlx-vlm names each token; mlx-lm gives its id (a name only with top_logprobs).
        tokens=tuple(str(entry.get("token", entry.get("id"))) for entry in content),
        logprobs=tuple(float(entry["logprob"]) for entry in content),
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        text=choice["message"]["content"],
    )


@dataclass(frozen=True)
class Scenario:
    """Requests sent together (late ones once the first batch is built), on a server's flags."""

    name: str
    what: str
    requests: tuple[Request, ...]
    quantized_kv_start: int = 0
    # Sent one at a time before the batch (not judged): the turns that requests follow.
    turns_before: tuple[Request, ...] = ()
    # Each judged request is also sent alone once before the batch (not judged): a prefix
    # cache then holds every prompt already, so its batched and alone runs restore as much.
    warm_first: bool = False
    # Speculative decoding with a draft model (written beside the model, same tokenizer);
    # mlx-lm's server then serves one request at a time, so nothing shares a batch.
    draft: bool = False
    server_flags: tuple[str, ...] = ()  # more of the server's own flags
    server_env: tuple[tuple[str, str], ...] = ()  # and settings from its environment
    # mlx-lm's server has no per-group deferral of quantization to test.
    servers: tuple[str, ...] = ("mlx-vlm", "mlx-lm")

    @property
    def batches(self) -> bool:
        """Whether the server batches this scenario's requests."""
        return not self.draft

    def launch(self, base: Launch, model_dir: Path) -> Launch:
        draft = None
        if self.draft:
            draft = Path(model_dir).parent / f"{Path(model_dir).name}-draft"
            if not draft.exists():
                write_model_dir(draft, server=base.server, seed=1, layers=1)
        return dataclasses.replace(
            base,
            quantized_kv_start=self.quantized_kv_start,
            draft_model=draft,
            extra=(*base.extra, *self.server_flags),
            env=(*base.env, *self.server_env),
        )


_SPECULATIVE = (
    Request("r0", 13, max_tokens=32, seed=50),
    Request("r1", 29, max_tokens=32, seed=51),
    Request("r2", 47, max_tokens=32, seed=52),
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "concurrent",
            "four requests of mixed lengths at once",
            tuple(Request(f"r{i}", words, seed=i) for i, words in enumerate((9, 23, 41, 70))),
        ),
        Scenario(
            "late-arrival",
            "two requests, then two more joining the running batch",
            (
                Request("r0", 30, max_tokens=48, seed=10),
                Request("r1", 12, max_tokens=48, seed=11),
                Request("late0", 20, late=True, seed=12),
                Request("late1", 55, late=True, seed=13),
            ),
        ),
        Scenario(
            "kv-start",
            "prompts on both sides of --quantized-kv-start 40: two short ones, then two long "
            "ones joining them (a full-precision group meets a TurboQuant one)",
            (
                Request("short0", 10, max_tokens=48, seed=20),
                Request("short1", 18, max_tokens=48, seed=21),
                Request("long0", 50, late=True, seed=22),
                Request("long1", 75, late=True, seed=23),
            ),
            quantized_kv_start=40,
            servers=("mlx-vlm",),
        ),
        Scenario(
            "follow-up",
            "a conversation's second turn (its first turn asked before, alone) with two other "
            "requests: a server with a prefix cache reuses the first turn",
            (
                Request("follow0", 11, follows="turn0", seed=31),
                Request("r1", 27, seed=32),
                Request("r2", 44, seed=33),
            ),
            turns_before=(Request("turn0", 16, seed=30),),
        ),
        Scenario(
            "speculative",
            "speculative decoding with a one-layer draft model (3 draft tokens a step): "
            "rejected drafts are trimmed from the caches; the prompt cache off",
            _SPECULATIVE,
            servers=("mlx-lm",),
            draft=True,
            server_flags=("--prompt-cache-size", "0"),
        ),
        Scenario(
            "speculative-reuse",
            "as speculative, with mlx-lm's prompt cache on: the alone run of each request "
            "starts from the cache its first run left",
            _SPECULATIVE,
            servers=("mlx-lm",),
            draft=True,
        ),
        Scenario(
            "prefix-cache",
            "mlx-vlm's automatic prefix cache on (APC_ENABLED=1, in memory): a conversation's "
            "second turn and two other requests, each sent alone once first, so that its "
            "batched and alone runs restore the same prefix",
            (
                Request("follow0", 11, follows="turn0", seed=61),
                Request("r1", 27, seed=62),
                Request("r2", 44, seed=63),
            ),
            turns_before=(Request("turn0", 16, seed=60),),
            warm_first=True,
            servers=("mlx-vlm",),
            server_env=(("APC_ENABLED", "1"), ("APC_DISK_ENABLED", "0")),
        ),
        Scenario(
            "faults",
            "a streaming client that hangs up after 3 chunks and a malformed request, among "
            "requests that must not notice, one of them late",
            (
                Request("r0", 20, max_tokens=48, seed=40),
                Request("r1", 33, max_tokens=48, seed=41),
                Request("hangup", 25, max_tokens=200, disconnect_after=3, seed=42),
                Request("malformed", 5, malformed=True),
                Request("late0", 41, late=True, seed=43),
            ),
        ),
    )
}


def _precisions(classes: Sequence[str]) -> set[str]:
    """Which precisions a request's rows were held in: quantized, full or both."""
    return {"quantized" if "TurboQuant" in name else "full" for name in classes}


@dataclass(frozen=True)
class Verdict:
    """One request's batched reply against its alone reply."""

    request: Request
    status: str  # PASS, FAIL or ERROR
    prompt_tokens: int | None
    first_difference: int | None
    logprob_gap: float | None
    served_by: tuple[str, ...]  # the cache classes its rows were in, batched
    served_alone_by: tuple[str, ...]  # and alone
    batched: Reply
    alone: Reply

    def detail(self) -> str:
        if self.status in ("REFUSED", "NOT REFUSED"):
            return f"malformed: HTTP {self.batched.status}"
        if self.status == "DISCONNECTED":
            return f"hung up after {self.request.disconnect_after} chunks"
        if self.status == "ERROR":
            return f"HTTP {self.batched.status}: {(self.batched.error or '').strip()[:120]}"
        if self.status == "FAIL":
            i = self.first_difference
            got = self.batched.tokens[i] if i < len(self.batched.tokens) else "(end)"
            want = self.alone.tokens[i] if i < len(self.alone.tokens) else "(end)"
            return f"token {i}: {got!r} batched, {want!r} alone"
        return ""

    def precision_differs(self) -> bool:
        """Whether the server put this request in another precision batched than alone.

        mlx-vlm's server decides per prefill group whether to quantize
        (``--quantized-kv-start``): a short request alone stays full precision,
        and the same request batched with a long one, or joined by one, is
        quantized. Its tokens may then differ, by the server's choice, not the cache's.
        """
        if not (self.served_by and self.served_alone_by):
            return False  # a run the log does not tie to a cache (e.g. a prefix-cache hit)
        return _precisions(self.served_by) != _precisions(self.served_alone_by)


@dataclass
class ScenarioResult:
    scenario: Scenario
    launch: Launch
    verdicts: list[Verdict] = field(default_factory=list)
    batch_log: BatchLog = field(default_factory=BatchLog)
    alone_log: BatchLog = field(default_factory=BatchLog)
    seconds: float = 0.0

    def passed(self) -> bool:
        return all(v.status == "PASS" for v in self.verdicts if v.request.judged)


def _first_difference(a: Sequence[str], b: Sequence[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _judge(
    request: Request, batched: Reply, alone: Reply, batch_log: BatchLog, alone_log: BatchLog
) -> Verdict:
    tokens = batched.prompt_tokens if batched.prompt_tokens is not None else alone.prompt_tokens
    served, served_alone = batch_log.classes_of(tokens), alone_log.classes_of(tokens)
    if request.disconnect_after is not None:
        status = "DISCONNECTED" if batched.status == 200 else "ERROR"
        return Verdict(request, status, None, None, None, served, (), batched, alone)
    if request.malformed:
        status = "REFUSED" if 400 <= batched.status < 500 else "NOT REFUSED"
        return Verdict(request, status, None, None, None, (), (), batched, alone)
    if batched.status != 200 or alone.status != 200:
        status, first, gap = "ERROR", None, None
    else:
        first = _first_difference(batched.tokens, alone.tokens)
        shared = len(batched.tokens) if first is None else first
        pairs = list(zip(batched.logprobs[:shared], alone.logprobs[:shared]))
        gap = max((abs(x - y) for x, y in pairs), default=0.0)
        status = "PASS" if first is None else "FAIL"
    return Verdict(request, status, tokens, first, gap, served, served_alone, batched, alone)


def _wait_for_first_batch(log_path: Path, offset: int) -> None:
    """Until the server's log, past ``offset``, shows a batch cache built (tqbatch serve's line)."""
    deadline = time.monotonic() + LATE_WAIT_SECONDS
    while time.monotonic() < deadline:
        if BATCH_BUILT in log_path.read_text(errors="replace")[offset:]:
            return
        time.sleep(0.002)


def _log_path(workdir: Path, run: str, launch: Launch) -> Path:
    """Where the server of ``run`` (a scenario's name, or load) on ``launch`` logs."""
    target = (launch.impl or launch.cache).replace(":", "-")
    return Path(workdir) / f"{run}-{launch.server}-{target}.log"


def _history(request: Request, earlier: dict[str, tuple[Request, Reply]]) -> list[dict]:
    """The conversation before ``request``: the turn it follows, asked and answered."""
    if request.follows is None:
        return []
    turn, reply = earlier[request.follows]
    return [
        {"role": "user", "content": turn.prompt()},
        {"role": "assistant", "content": reply.text},
    ]


def _send_together(
    base: str,
    model: str,
    requests: Sequence[Request],
    earlier: dict[str, tuple[Request, Reply]],
    log_path: Path,
    offset: int,
) -> list[Reply]:
    replies: list[Reply | None] = [None] * len(requests)

    def send(i: int) -> None:
        if requests[i].late:
            _wait_for_first_batch(log_path, offset)
        replies[i] = chat(base, model, requests[i], _history(requests[i], earlier))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies  # type: ignore[return-value]


def run_scenario(
    base: Launch, scenario: Scenario, model_dir: Path, workdir: Path
) -> ScenarioResult:
    """Run ``scenario`` on a server started from ``base`` with the scenario's flags."""
    lengths = [r.words for r in scenario.requests if r.judged]
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"{scenario.name}: requests need distinct prompt lengths (the log's key)")
    launch = scenario.launch(base, Path(model_dir))
    log_path = _log_path(workdir, scenario.name, launch)
    model = str(model_dir)
    start = time.monotonic()
    with running(launch, Path(model_dir), log_path) as server:
        url = server.url
        earlier = {}
        for turn in scenario.turns_before:  # one at a time, before the batch
            earlier[turn.name] = (turn, chat(url, model, turn, _history(turn, earlier)))
            if earlier[turn.name][1].status != 200:
                raise ServerFailed(f"{scenario.name}: turn {turn.name}: {earlier[turn.name][1]}")
        for request in scenario.requests if scenario.warm_first else ():
            if request.judged:
                chat(url, model, request, _history(request, earlier))  # its reply: not judged
        offset = len(log_path.read_text(errors="replace"))
        batched = _send_together(url, model, scenario.requests, earlier, log_path, offset)
        batch_text = log_path.read_text(errors="replace")
        alone = [
            chat(url, model, r, _history(r, earlier)) if r.judged else Reply(status=0)
            for r in scenario.requests
        ]
        alone_text = log_path.read_text(errors="replace")[len(batch_text) :]
        batch_text = batch_text[offset:]
    batch_log, alone_log = read_batch_log(batch_text), read_batch_log(alone_text)
    result = ScenarioResult(scenario, launch, batch_log=batch_log, alone_log=alone_log)
    result.verdicts = [
        _judge(r, b, a, batch_log, alone_log) for r, b, a in zip(scenario.requests, batched, alone)
    ]
    result.seconds = time.monotonic() - start
    return result


@dataclass
class LoadResult:
    """A bounded load run: every reply judged against its alone run, throughput and memory."""

    launch: Launch
    requests: int
    concurrency: int
    verdicts: list[Verdict] = field(default_factory=list)
    batch_log: BatchLog = field(default_factory=BatchLog)
    seconds: float = 0.0  # the batched phase's wall time
    completion_tokens: int = 0
    peak_rss_bytes: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0


def load_requests(n: int, *, max_tokens: int = 32) -> tuple[Request, ...]:
    """``n`` requests of distinct prompt lengths (8 words and up: the log's key), seeded apart."""
    return tuple(Request(f"q{i}", 8 + i, max_tokens=max_tokens, seed=100 + i) for i in range(n))


def run_load(
    base: Launch, model_dir: Path, workdir: Path, *, requests: int = 64, concurrency: int = 8
) -> LoadResult:
    """``requests`` requests, ``concurrency`` at a time, then each alone; peak server memory."""
    from concurrent.futures import ThreadPoolExecutor

    load = load_requests(requests)
    launch = dataclasses.replace(base, max_num_seqs=concurrency)
    log_path = _log_path(workdir, "load", launch)
    model = str(model_dir)
    result = LoadResult(launch, requests, concurrency)
    with running(launch, Path(model_dir), log_path) as server:
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            batched = list(pool.map(lambda r: chat(server.url, model, r), load))
        result.seconds = time.monotonic() - start
        result.peak_rss_bytes = server.peak_rss_bytes()
        batch_text = log_path.read_text(errors="replace")
        alone = [chat(server.url, model, r) for r in load]
        alone_text = log_path.read_text(errors="replace")[len(batch_text) :]
    result.batch_log = read_batch_log(batch_text)
    alone_log = read_batch_log(alone_text)
    result.verdicts = [
        _judge(r, b, a, result.batch_log, alone_log) for r, b, a in zip(load, batched, alone)
    ]
    result.completion_tokens = sum(len(b.tokens) for b in batched)
    return result
