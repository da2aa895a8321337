"""Real vLLM engines in separate processes on one node-shared host tier
(``host_share``, decision 0016): tiny Llama, float32, greedy, no disk or Redis.

Each engine runs in a child process (this file run as a script: ``child``) that
builds an in-process ``LLM`` and answers commands read from its stdin, one JSON line
each, with one line on its stdout marked ``KVSHARE``: the tokens, the requests'
cached tokens and its scheduler half's host hit tokens (its own metrics). The test
waits on those lines and on process exits, never on time. Every child and the
share's node process are stopped by pid at the end, on failure too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import CHUNK_BYTES, PROMPTS
from share_support import share_config, stop_node_process

import kvoffload
from kvoffload.share.client import ShareDirectory
from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import HEADER_BYTES

MARK = "KVSHARE "
HERE = Path(__file__).resolve()
SHARE_CHUNKS = 64  # room for every prompt used here: nothing is evicted


class Child:
    """One engine process; ``ask`` sends a command and returns its answer."""

    def __init__(self, model: Path, extra: dict[str, Any] | None, log: Path) -> None:
        source = str(Path(kvoffload.__file__).resolve().parents[1])  # this kvoffload
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "child", str(model), json.dumps(extra)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=HERE.parent,
        )
        self.read()  # the engine is built

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                return answer
        raise AssertionError(f"engine exited ({self.proc.wait()}); see {self.log.name}")

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def ask(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return self.read()

    def close(self) -> int:
        """Ask the engine to exit, and wait for it (kill it if it cannot be asked)."""
        if self.proc.poll() is None:
            try:
                self.send(exit=True)
            except OSError:
                self.proc.kill()
        code = self.proc.wait()
        self.log.close()
        return code

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def share(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A share's configuration under a private root; its node process is stopped by
    pid at the end."""
    extra = share_config(tmp_path / "shm", f"wire-{os.getpid()}", SHARE_CHUNKS * CHUNK_BYTES)
    try:
        yield extra
    finally:
        stop_node_process(extra)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def counts(extra: dict[str, Any]) -> Any:
    """The whole share's counts, asked of its node process by a bare client."""
    paths = SharePaths(extra["host_share"], Path(extra["host_share_root"]))
    client = ShareDirectory(paths, start_server=False, lease=False, timeout_s=5.0)
    try:
        assert client.wait_ready(5.0)
        return client.share_counts()
    finally:
        client.close()


def slab_bytes(extra: dict[str, Any]) -> int:
    """Bytes of slots in the share's slab files (each also holds a small header)."""
    root = Path(extra["host_share_root"])
    files = list(root.glob(f"kvoffload-{extra['host_share']}.slab.*"))
    assert len(files) == 1  # one rank
    return sum(p.stat().st_size - HEADER_BYTES for p in files)


def test_engine_b_is_served_from_what_engine_a_stored(
    tiny_model: Path, tmp_path: Path, share: dict[str, Any], children: list[Child]
) -> None:
    prompts = PROMPTS[:2]
    reference = Child(tiny_model, None, tmp_path / "reference.log")
    children.append(reference)
    expected = reference.ask(prompts=prompts)["tokens"]
    assert reference.close() == 0

    a = Child(tiny_model, share, tmp_path / "a.log")
    children.append(a)
    first = a.ask(prompts=prompts)
    assert first["tokens"] == expected
    assert first["host_hit_tokens"] == 0  # nothing was stored before

    b = Child(tiny_model, share, tmp_path / "b.log")  # A still runs
    children.append(b)
    second = b.ask(prompts=prompts)
    assert second["tokens"] == expected
    # B's own prefix cache is cold: every hit is a load from the share, here every
    # chunk of both prompts.
    assert second["host_hit_tokens"] == sum(len(p) for p in prompts), second
    assert second["cached"] == [len(p) for p in prompts], second
    assert second["share_calls"]["connects"] >= 1 and second["share_calls"]["timeouts"] == 0

    assert slab_bytes(share) <= share["cpu_bytes"]  # one share, not one per engine
    assert a.close() == 0 and b.close() == 0
    left = counts(share)
    assert left is not None and left.pinned == 0 and left.storing == 0
    assert left.chunks == len(prompts) * 8  # stored once, though both engines ran them


def test_a_killed_engine_leaves_the_others_serving_and_a_restart_warm(
    tiny_model: Path, tmp_path: Path, share: dict[str, Any], children: list[Child]
) -> None:
    stream = PROMPTS[1:4]
    reference = Child(tiny_model, None, tmp_path / "reference.log")
    children.append(reference)
    expected = reference.ask(prompts=[PROMPTS[0], *stream])["tokens"]
    assert reference.close() == 0

    a = Child(tiny_model, share, tmp_path / "a.log")
    children.append(a)
    assert a.ask(prompts=[PROMPTS[0]])["tokens"] == expected[:1]  # stored (settled)
    b = Child(tiny_model, share, tmp_path / "b.log")
    children.append(b)
    # A serves a stream one request at a time without waiting for its stores; it is
    # killed as soon as it answered the first one (its stores in flight or not).
    a.send(prompts=stream, stream=True, settle=False)
    assert a.read()["tokens"] == expected[1:2]
    a.kill()

    served = b.ask(prompts=[PROMPTS[0], *stream])
    assert served["tokens"] == expected
    assert served["host_hit_tokens"] >= len(PROMPTS[0])  # prompt 0, stored by A before

    restarted = Child(tiny_model, share, tmp_path / "a2.log")
    children.append(restarted)
    again = restarted.ask(prompts=[PROMPTS[0]])
    assert again["tokens"] == expected[:1]
    assert again["host_hit_tokens"] == len(PROMPTS[0]), again  # warm at its first request
    assert b.close() == 0 and restarted.close() == 0
    left = counts(share)
    assert left is not None and left.pinned == 0 and left.storing == 0


# ---------------------------------------------------------------- the child process


def child_main(model: str, extra_json: str) -> int:
    """Build the engine, answer commands from stdin until ``exit`` (see module doc)."""
    from llm_support import engine, generate, half, settle, tokens

    from kvoffload.adapters.vllm.host_share import LINK_OUTCOMES

    extra = json.loads(extra_json)
    answers = os.fdopen(os.dup(1), "w")  # the answers' channel: everything else
    os.dup2(2, 1)  # written to stdout (vLLM's logs) goes to the log instead
    sys.stdout = sys.stderr

    def answer(**fields: Any) -> None:
        answers.write(MARK + json.dumps(fields) + "\n")
        answers.flush()

    with engine(Path(model), extra, disable_log_stats=True) as llm:
        answer(ready=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("exit"):
                break
            batches = (
                [[p] for p in command["prompts"]] if command.get("stream") else [command["prompts"]]
            )
            for batch in batches:
                outputs = generate(llm, batch)
                if command.get("settle", True) and extra is not None:
                    settle(llm)
                reading: dict[str, Any] = {}
                if extra is not None:
                    side = llm.llm_engine.engine_core.engine_core.scheduler.connector
                    metrics = side.scheduler_side.read_metrics(with_gauges=False)
                    reading = {
                        "host_hit_tokens": int(metrics.value("hit_tokens_total", tier="host")),
                        "share_calls": {
                            o: int(metrics.value("host_share_calls_total", outcome=o))
                            for o in LINK_OUTCOMES
                        },
                    }
                    assert half(llm).anomalies.counts == {}
                answer(
                    tokens=tokens(outputs),
                    cached=[o.num_cached_tokens for o in outputs],
                    **reading,
                )
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    sys.exit(child_main(sys.argv[2], sys.argv[3]))
