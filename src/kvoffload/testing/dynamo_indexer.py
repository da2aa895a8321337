"""Dynamo's standalone KV indexer for tests and benchmarks: ``python -m dynamo.indexer``
from ``.venv-dynamo`` (``scripts/setup-dynamo``), subscribed to engines' vLLM ZMQ event
streams, asked over HTTP.

:class:`Indexer` starts it (``start``, once the engines' publishers are bound: it
registers each as a worker, ``id=tcp://127.0.0.1:port``), waits until it answers, and
is stopped by its pid (``stop``; a context manager too). :meth:`Indexer.query` answers
each worker's cumulative matched tokens for a token sequence: ``gpu``, ``cpu`` (engine
or host memory), ``disk`` (any of the three). The indexer is an external asynchronous
process: :func:`poll` waits on its answers with a deadline (never a fixed sleep).
Without ``.venv-dynamo``, :class:`Indexer` raises :class:`IndexerMissing` (tests skip
or fail on it: ``tests/vllm/dynamo_support.py``).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from kvoffload.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
TIERS = ("gpu", "cpu", "disk")

Answer = dict[int, dict[str, int]]


class IndexerMissing(RuntimeError):
    """Dynamo's indexer is not installed here."""


def dynamo_python() -> Path:
    """The Python of ``.venv-dynamo`` (:class:`IndexerMissing` when it is missing)."""
    if DYNAMO_PYTHON.exists():
        return DYNAMO_PYTHON
    raise IndexerMissing(f"{DYNAMO_PYTHON} is missing (./scripts/setup-dynamo makes it)")


class Indexer:
    """One indexer process (see the module docstring)."""

    def __init__(self, block_size: int, log: Path) -> None:
        self.python = dynamo_python()
        self.block_size = block_size
        self.log = log
        self.http = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers: list[int] = []

    def start(self, workers: Mapping[int, int], timeout_s: float = 30.0) -> Indexer:
        """Start it with ``workers`` (worker id -> ZMQ port on loopback)."""
        self.workers = list(workers)
        spec = ",".join(f"{w}=tcp://127.0.0.1:{port}" for w, port in workers.items())
        argv = [str(self.python), "-m", "dynamo.indexer", "--block-size", str(self.block_size)]
        argv += ["--port", str(self.http), "--threads", "1", "--workers", spec]
        with self.log.open("wb") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                self.query([1] * self.block_size)
                return self
            except OSError:
                assert time.monotonic() < deadline, "the indexer did not answer"
                time.sleep(0.1)

    def query(self, tokens: list[int]) -> Answer:
        """Each worker's ``gpu``/``cpu``/``disk`` matched tokens (zeros: none)."""
        body = json.dumps({"token_ids": tokens, "model_name": "default"}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}/query", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            answer = json.loads(r.read())
        instances = answer.get("instances", {})
        return {
            w: {t: int(instances.get(str(w), {}).get(t, 0)) for t in TIERS} for w in self.workers
        }

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Indexer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


T = TypeVar("T")


def poll(ask: Callable[[], T], ok: Callable[[T], bool], within: float = 30.0) -> T | None:
    """``ask()``'s answer once ``ok`` holds; None past ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        answer = ask()
        if ok(answer):
            return answer
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def credited(ask: Callable[[], T], ok: Callable[[T], bool], within: float = 30.0) -> T:
    """``ask()``'s answer once ``ok`` holds (AssertionError with the last answer past
    the deadline)."""
    answer = poll(ask, ok, within)
    assert answer is not None, f"the indexer still answers {ask()} after {within} s"
    return answer
