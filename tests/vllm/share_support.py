"""Test support for engines on a node-shared host tier (``host_share``): a share's
configuration under a private root, stopping the node process an engine started
(:mod:`kvoffload.testing.share_process`), the whole share's counts, and an engine in
a process of its own (:class:`Child`: this file run as a script, ``child``, builds an
in-process ``LLM`` and answers commands read from its stdin, one JSON line each, with
one line on its stdout marked ``KVSHARE``: the tokens, the requests' cached tokens,
its scheduler half's hit tokens per tier and share call counts, its own metrics)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvoffload
from kvoffload.share.client import ShareDirectory
from kvoffload.share.paths import SharePaths
from kvoffload.testing.share_process import stop_node_process as stop_node_process_of

MARK = "KVSHARE "
HERE = Path(__file__).resolve()


def share_config(root: Path, name: str, cpu_bytes: int) -> dict[str, Any]:
    """``kv_connector_extra_config`` entries for a share ``name`` under ``root``. The
    call deadline is generous: the test machine's cores are busy, and a timed-out
    call (a miss by design) must not decide what a test observes."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        "cpu_bytes": cpu_bytes,
        "host_share": name,
        "host_share_root": str(root),
        "host_share_timeout_ms": 2000,
    }


def stop_node_process(extra: dict[str, Any], timeout_s: float = 30.0) -> None:
    """Stop the node process of the share ``extra`` names, and wait until it exited."""
    name, root = extra["host_share"], Path(extra["host_share_root"])
    assert stop_node_process_of(name, root, timeout_s), (
        f"the share {name!r}'s node process did not stop"
    )


def counts(extra: dict[str, Any]) -> Any:
    """The whole share's counts, asked of its node process by a bare client."""
    paths = SharePaths(extra["host_share"], Path(extra["host_share_root"]))
    client = ShareDirectory(
        paths, start_server=False, lease=False, timeout_s=5.0, users=False, fence=False
    )
    try:
        assert client.wait_ready(5.0)
        return client.share_counts()
    finally:
        client.close()


class Child:
    """One engine process; ``ask`` sends a command and returns its answer."""

    def __init__(
        self,
        model: Path,
        extra: dict[str, Any] | None,
        log: Path,
        options: dict[str, Any] | None = None,
    ) -> None:
        """``options``: the engine's own (``kv_blocks``, ``max_model_len``,
        ``max_num_seqs``) and ``kv_events_port`` (vLLM's ZMQ publisher bound there)."""
        source = str(Path(kvoffload.__file__).resolve().parents[1])  # this kvoffload
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE),
                "child",
                str(model),
                json.dumps(extra),
                json.dumps(options or {}),
            ],
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


def child_main(model: str, extra_json: str, options_json: str = "{}") -> int:
    """Build the engine, answer commands from stdin until ``exit`` (see module doc)."""
    from llm_support import engine, generate, half, settle, tokens

    from kvoffload.adapters.vllm.link_metrics import LINK_OUTCOMES

    extra = json.loads(extra_json)
    answers = os.fdopen(os.dup(1), "w")  # the answers' channel: everything else
    os.dup2(2, 1)  # written to stdout (vLLM's logs) goes to the log instead
    sys.stdout = sys.stderr

    def answer(**fields: Any) -> None:
        answers.write(MARK + json.dumps(fields) + "\n")
        answers.flush()

    options = json.loads(options_json)
    port = options.pop("kv_events_port", None)
    if port is not None:
        from vllm.config import KVEventsConfig

        options["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}"
        )
    with engine(Path(model), extra, disable_log_stats=True, **options) as llm:
        steps = count_steps(llm) if extra is not None else [0]
        answer(ready=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("exit"):
                break
            if command.get("report"):
                answer(steps=steps[0], announcer=announcer_counts(llm))
                continue
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
                        "disk_hit_tokens": int(metrics.value("hit_tokens_total", tier="disk")),
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


def count_steps(llm: Any) -> list[int]:
    """A counter of the engine's steps (its scheduler half's plans), in a list."""
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    steps = [0]
    build = side.build_connector_meta

    def counted(output: Any) -> Any:
        steps[0] += 1
        return build(output)

    side.build_connector_meta = counted
    return steps


def announcer_counts(llm: Any) -> dict[str, int]:
    """The share announcer's counts and its event sink's (zeros without one)."""
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    announcer = side.events.announcer if side.events is not None else None
    counts = dict(announcer.stats) if announcer is not None else {}
    counts.update(direct=side.sink.direct, deferred=side.sink.deferred)
    for name in ("stored", "removed", "bad_records"):
        counts.setdefault(name, 0)
    return counts


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    sys.exit(child_main(*sys.argv[2:5]))
