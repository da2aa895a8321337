"""Real vLLM engines in processes of their own, for bench/'s multi-engine benchmarks
(``share_engines.py``, ``fleet_router.py``).

:class:`Engine` starts this file as ``child``: an in-process ``LLM`` (CPU, greedy,
``max_tokens`` 1, one request at a time, ``BLOCK``-token blocks, a KV cache of
``kv_blocks`` blocks) that reads one JSON command a line from its stdin and answers
each with one line on its stdout marked ``KVSHARE`` (everything else written to stdout,
vLLM's logs included, goes to the engine's log file):

- ``{"prompt": [...]}``: ``tokens`` (the output), ``seconds`` (the request's latency,
  measured around ``generate``: its time to first token) and ``cached`` (vLLM's
  ``num_cached_tokens``: the engine's prefix-cache hit plus what the connector
  loaded). With kvoffload, the engine then drains its stores (not timed): stepped
  until they are reported, so that another engine finds them in a shared tier.
- ``{"metrics": true}``: kvoffload's cumulative counters: ``hit_tokens`` by tier,
  ``stored_chunks`` (chunks stored from the engine into host memory), ``share_calls``
  (the node share link's calls by outcome, non-zero only) and ``announcer`` (the share
  announcer's counts; empty without one). All empty without kvoffload.
- ``{"exit": true}``: shut the engine down and exit.

Options (a JSON object): ``kv_blocks`` (default 32), ``max_model_len`` (default 512)
and ``kv_events_port`` (vLLM's KV events on, its ZMQ publisher bound to
``tcp://*:<port>``; absent: events off).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARK = "KVSHARE "
BLOCK = 32
HERE = Path(__file__).resolve()


class Engine:
    """One engine process. The constructor returns once it is started, not built:
    :meth:`read` its first answer (``ready``) before asking it anything, so that
    several engines are built at once."""

    def __init__(
        self, model: Path, extra: dict[str, Any] | None, options: dict[str, Any], log: Path
    ) -> None:
        import kvoffload

        source = str(Path(kvoffload.__file__).resolve().parents[1])  # this kvoffload first
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
        self.log = log.open("w")
        args = [sys.executable, str(HERE), "child", str(model), json.dumps(extra)]
        self.proc = subprocess.Popen(
            [*args, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def read(self) -> dict[str, Any]:
        """The engine's next answer (RuntimeError, naming its log, if it exited)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                answer: dict[str, Any] = json.loads(line[len(MARK) :])
                return answer
        raise RuntimeError(f"engine exited ({self.proc.wait()}); see {self.log.name}")

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        """Ask the engine to exit and wait for it (killed, by its pid, if it cannot)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError):
                self.ask(exit=True)
            if self.proc.poll() is None:
                self.proc.kill()
        self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- the child process


def child_main(model: str, extra_json: str, options_json: str) -> int:
    """One engine: answer commands from stdin until ``exit`` (see the module doc)."""
    extra = json.loads(extra_json)
    options = json.loads(options_json)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's own output goes to the log
    sys.stdout = sys.stderr

    from vllm.inputs import TokensPrompt

    from kvoffload.testing.vllm_cpu import cpu_llm_args, kvoffload_transfer
    from vllm import LLM, SamplingParams

    def answer(**fields: Any) -> None:
        answers.write(MARK + json.dumps(fields) + "\n")
        answers.flush()

    # The KV cache sized in blocks: float32 K and V of every layer, per block.
    shape = json.loads((Path(model) / "config.json").read_text())
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    layers, kv_heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    block_bytes = 2 * layers * kv_heads * head_dim * BLOCK * 4
    kv_bytes = int(options.get("kv_blocks", 32)) * block_bytes
    more: dict[str, Any] = {}
    port = options.get("kv_events_port")
    if port is not None:
        from vllm.config import KVEventsConfig

        more["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}"
        )
    args = cpu_llm_args(model, BLOCK, kv_bytes, "float32")
    llm = LLM(
        **{**args, "max_model_len": int(options.get("max_model_len", 512))},
        max_num_seqs=1,
        kv_transfer_config=kvoffload_transfer(extra),
        disable_log_stats=True,
        **more,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector if extra is not None else None
    answer(ready=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        if command.get("metrics"):
            answer(**metrics(connector))
            continue
        began = time.perf_counter()
        (output,) = llm.generate(
            [TokensPrompt(prompt_token_ids=command["prompt"])], params, use_tqdm=False
        )
        seconds = time.perf_counter() - began
        if connector is not None:
            drain(llm)
        answer(
            tokens=list(output.outputs[0].token_ids),
            seconds=seconds,
            cached=int(output.num_cached_tokens or 0),
        )
    llm.llm_engine.engine_core.shutdown()
    return 0


def metrics(connector: Any) -> dict[str, Any]:
    """kvoffload's counters of this engine (see the module doc; empty without it)."""
    if connector is None:
        return {"hit_tokens": {}, "stored_chunks": 0, "share_calls": {}, "announcer": {}}
    side = connector.scheduler_side
    reading = side.read_metrics(with_gauges=False)
    hits = {t: int(reading.value("hit_tokens_total", tier=t)) for t in ("host", "disk")}
    stored = int(reading.value("transferred_chunks_total", direction="store", tier="host"))
    calls = {
        series[1][0][1]: int(n)
        for series, n in reading.counters.items()
        if series[0] == "host_share_calls_total" and n
    }
    events = side.events  # adapters/vllm/announcements.py (None: KV events off)
    announcer = dict(events.announcer.stats) if events and events.announcer else {}
    return {
        "hit_tokens": hits,
        "stored_chunks": stored,
        "share_calls": calls,
        "announcer": announcer,
    }


def drain(llm: Any) -> None:
    """Step the engine until kvoffload's stores are reported (copies waited for)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    worker = get_kv_transfer_group().worker_side
    for _ in range(50):
        if not core.scheduler.has_requests():
            return
        worker.worker.wait(worker.worker.running())
        llm.llm_engine.step()


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    sys.exit(child_main(sys.argv[2], sys.argv[3], sys.argv[4]))
