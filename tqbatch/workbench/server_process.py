"""A real HTTP server process under test: started on 127.0.0.1, probed, always stopped.

``Launch`` says which server (mlx-vlm's or mlx-lm's), on which cache and with
which flags; ``running(launch, model_dir, log_path)`` starts it through
``tqbatch serve`` (so the log names the class of every batch cache it builds)
on a free port, waits until its readiness endpoint answers, yields its base
URL and stops it on the way out, killing it if it does not stop in time. The
process's stdout and stderr go to ``log_path``: the log is how a client sees
which cache served a request (``tqbatch.workbench.server_log``).

Nothing is downloaded: the model is a local directory
(``tqbatch.workbench.local_model``) and the Hugging Face libraries run offline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHES", "Launch", "RunningServer", "ServerFailed", "free_port", "running"]

# The cache a launch puts behind the server: tqbatch's class, mlx-vlm's own
# TurboQuant batch class, or no quantization (mlx-vlm's BatchKVCache, the baseline).
CACHES = ("tqbatch", "mlx-vlm", "BatchKVCache")
# mlx-lm's /health answers before the model is loaded (its first request then waits for
# the load); its /v1/models scans the Hugging Face cache directory, which must exist.
READY_PATHS = {"mlx-vlm": "/health", "mlx-lm": "/health"}
START_SECONDS = 120.0
STOP_SECONDS = 10.0


class ServerFailed(RuntimeError):
    """The server process exited or never became ready; the message ends with its log."""


@dataclass(frozen=True)
class Launch:
    """One server configuration: whose server, which cache, its batching and quantization flags."""

    server: str = "mlx-vlm"
    cache: str = "tqbatch"
    bits: float = 4.0
    max_num_seqs: int = 4
    quantized_kv_start: int = 0
    extra: tuple[str, ...] = ()  # more of the server's own flags
    impl: str | None = None  # MODULE:CLASS, a subclass of tqbatch's class to serve on
    draft_model: Path | None = None  # mlx-lm's server: speculative decoding with this model
    num_draft_tokens: int = 3
    env: tuple[tuple[str, str], ...] = ()  # the server's settings read from the environment

    def __post_init__(self):
        if self.server not in READY_PATHS:
            raise ValueError(f"server must be one of {sorted(READY_PATHS)}, got {self.server!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.server == "mlx-lm" and self.cache == "mlx-vlm":
            raise ValueError("mlx-lm's server has no mlx-vlm TurboQuant batch path")
        if self.draft_model is not None and self.server != "mlx-lm":
            raise ValueError("a draft model (plain speculative decoding) is mlx-lm's server's")
        if self.impl is not None and self.cache != "tqbatch":
            raise ValueError("impl replaces tqbatch's class: it needs cache='tqbatch'")

    @property
    def label(self) -> str:
        return f"{self.server} server, {self.impl or self.cache}"

    def argv(self, model_dir: Path, port: int) -> list[str]:
        """The command line: ``tqbatch serve`` with the server's own flags after ``--``."""
        where = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
        if self.server == "mlx-vlm":
            serve = [
                "serve",
                "mlx-vlm",
                "--cache",
                "mlx-vlm" if self.cache != "tqbatch" else "tqbatch",
            ]
            flags = ["--max-num-seqs", str(self.max_num_seqs)]
            if self.cache != "BatchKVCache":
                flags += ["--kv-bits", f"{self.bits:g}", "--kv-quant-scheme", "turboquant"]
                flags += ["--quantized-kv-start", str(self.quantized_kv_start)]
        else:
            # mlx-lm's server on tqbatch's caches, or (baseline) mlx-lm's own, unquantized.
            serve = ["serve", "mlx-lm", "--bits", f"{self.bits:g}"]
            if self.cache == "BatchKVCache":
                serve += ["--cache", "none"]
            flags = ["--decode-concurrency", str(self.max_num_seqs)]
            flags += ["--prompt-concurrency", str(self.max_num_seqs)]
            if self.draft_model is not None:
                flags += ["--draft-model", str(self.draft_model)]
                flags += ["--num-draft-tokens", str(self.num_draft_tokens)]
        if self.impl is not None:
            serve += ["--impl", self.impl]
        return [sys.executable, "-m", "tqbatch", *serve, "--", *where, *flags, *self.extra]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log_path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclass(frozen=True)
class RunningServer:
    """A started server: its base URL and process."""

    url: str
    process: subprocess.Popen

    def peak_rss_bytes(self) -> int | None:
        """The process's peak resident memory so far (Linux's ``VmHWM``; None elsewhere)."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return None


@contextmanager
def running(launch: Launch, model_dir: Path, log_path: Path) -> Iterator[RunningServer]:
    """Start ``launch`` on ``model_dir``; yield it once ready (``url``: ``http://127.0.0.1:PORT``);
    stop it."""
    port = free_port()
    hub_cache = Path(log_path).parent / "hf-hub-cache"  # empty: nothing is read from it
    hub_cache.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub_cache),
        **dict(launch.env),
    }
    env.pop("CI", None)  # the server's own behaviour, not a CI profile of tqbatch's
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            launch.argv(Path(model_dir), port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while not _ready(base + READY_PATHS[launch.server]):
            if process.poll() is not None:
                raise ServerFailed(
                    f"{launch.label} exited with {process.returncode} before it was ready:\n"
                    + _log_tail(log_path)
                )
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"{launch.label} not ready within {START_SECONDS:g} s:\n" + _log_tail(log_path)
                )
            time.sleep(0.2)
        yield RunningServer(base, process)
    finally:
        process.terminate()
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
