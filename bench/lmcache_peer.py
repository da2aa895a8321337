"""LMCache 0.5.6 as a peer in the e2e "tiers" workload: the pieces both sides share.

The benchmark (kvoffload's venv) cannot build an LMCache engine in its own process:
LMCache lives in a venv of its own (``bench/lmcache_env.py``). So each LMCache run
is a subprocess, ``bench/lmcache_runner.py`` run by that venv's python with
``PYTHONPATH=<repo>/src:<repo>/bench``, talking through two JSON files:

- the *job* (:func:`job`): the engine's :class:`EngineSpec` fields (no connector),
  the batches (prompt token ids and answer lengths), the L1 bytes, the fs L2
  directory (None: no L2) and LMCache's chunk size in tokens;
- the *result* (:func:`result_json` / :func:`parse_result`): every request's
  ``RequestResult``, the generate wall time, vLLM's prefix-cache and connector hit
  counters, and what LMCache's server counted during the batches (its Prometheus
  ``/metrics`` counters on its HTTP port, summed over labels, after minus before).

The runner starts ``lmcache server`` (:func:`server_command`: multiprocess mode,
``--supported-transfer-mode auto``, L1 = the config's host bytes, the ``fs`` L2
adapter when asked), waits for it with a bounded poll (:func:`wait_ready`), and
builds vLLM with ``kv_connector: LMCacheMPConnector`` (:func:`connector_config`).
This module imports only the standard library and ``kvoffload.demos.vllm_runner``
(whose import needs neither torch nor vLLM), so both venvs can import it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from kvoffload.demos.vllm_runner import EngineSpec, PromptLike, RequestResult, RunResult

GiB = 1 << 30
HOST = "127.0.0.1"
EVICTION = "LRU"  # lmcache server requires one with --l1-size-gb; LRU as kvoffload's
RUNNER = Path(__file__).resolve().with_name("lmcache_runner.py")
REPO = Path(__file__).resolve().parents[1]


class PeerFailed(RuntimeError):
    """An LMCache run did not produce a result; ``str()`` is a one-line reason."""


# --- the job -----------------------------------------------------------------------


def job(
    spec: EngineSpec,
    batches: Sequence[Sequence[PromptLike]],
    l1_bytes: int,
    l2_dir: Path | None,
    chunk_tokens: int,
) -> dict[str, Any]:
    """The runner's job as a JSON-able dict (``spec.kv_transfer_config`` is not sent:
    the runner sets LMCache's)."""
    engine = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "kv_transfer_config"}
    engine["model"] = str(spec.model)
    return {
        "engine": engine,
        "batches": [[[list(r.prompt), r.output_tokens] for r in b] for b in batches],
        "l1_bytes": int(l1_bytes),
        "l2_dir": None if l2_dir is None else str(l2_dir),
        "chunk_tokens": int(chunk_tokens),
    }


def engine_spec(job: Mapping[str, Any], transfer: Mapping[str, Any]) -> EngineSpec:
    """The job's EngineSpec, with ``transfer`` as its ``kv_transfer_config``."""
    engine = dict(job["engine"])
    engine["model"] = Path(engine["model"])
    return EngineSpec(**engine, kv_transfer_config=dict(transfer))


class _Prompt:
    def __init__(self, prompt: Sequence[int], output_tokens: int) -> None:
        self.prompt = tuple(prompt)
        self.output_tokens = int(output_tokens)


def job_batches(job: Mapping[str, Any]) -> list[list[PromptLike]]:
    return [[_Prompt(p, n) for p, n in batch] for batch in job["batches"]]


# --- the server --------------------------------------------------------------------


def server_command(
    lmcache: Path | str,
    port: int,
    http_port: int,
    *,
    l1_bytes: int,
    chunk_tokens: int,
    l2_dir: Path | str | None,
) -> list[str]:
    """``lmcache server`` in multiprocess mode on loopback (requests on ``port``, its
    HTTP API with ``/healthcheck`` and ``/metrics`` on ``http_port``): L1 of
    ``l1_bytes`` (LMCache takes GiB), chunks of ``chunk_tokens``, an ``fs`` L2 in
    ``l2_dir`` when given."""
    cmd = [
        str(lmcache),
        "server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--http-host",
        HOST,
        "--http-port",
        str(http_port),
        "--supported-transfer-mode",
        "auto",
        "--chunk-size",
        str(chunk_tokens),
        "--l1-size-gb",
        repr(l1_bytes / GiB),
        "--eviction-policy",
        EVICTION,
    ]
    if l2_dir is not None:
        cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(l2_dir)})]
    return cmd


def connector_config(port: int) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for LMCache's multiprocess connector on ``port``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port},
    }


def wait_ready(
    probe: Callable[[], bool],
    alive: Callable[[], bool],
    timeout_s: float,
    *,
    interval_s: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Poll ``probe`` until it answers True; seconds waited. Raises PeerFailed when
    ``alive`` says the server exited or ``timeout_s`` passes first."""
    start = clock()
    while True:
        if probe():
            return clock() - start
        if not alive():
            raise PeerFailed("lmcache server exited before it was ready")
        if clock() - start >= timeout_s:
            raise PeerFailed(f"lmcache server not ready after {timeout_s:.0f} s")
        sleep(interval_s)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {counter name without ``_total``: value summed over labels}
    (only ``*_total`` samples)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if not name.endswith("_total"):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        key = name[: -len("_total")]
        out[key] = out.get(key, 0.0) + number
    return out


def grown(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each counter grew by between two readings."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


# --- the result --------------------------------------------------------------------


def result_json(result: RunResult, counters: Mapping[str, float]) -> dict[str, Any]:
    return {
        "requests": [asdict(r) for r in result.requests],
        "wall_s": result.wall_s,
        "local_hit_tokens": result.local_hit_tokens,
        "external_hit_tokens": result.external_hit_tokens,
        "lmcache": dict(counters),
    }


def parse_result(data: Mapping[str, Any]) -> tuple[RunResult, dict[str, float]]:
    """The runner's result -> (RunResult, LMCache's counters)."""
    requests = []
    for row in data["requests"]:
        fields_ = {**row, "token_ids": tuple(row["token_ids"])}
        requests.append(RequestResult(**fields_))
    result = RunResult(
        tuple(requests),
        float(data["wall_s"]),
        int(data["local_hit_tokens"]),
        int(data["external_hit_tokens"]),
    )
    return result, {str(k): float(v) for k, v in data["lmcache"].items()}


def allowed_plugins(entry_points: Iterable[tuple[str, str]]) -> str | None:
    """``VLLM_PLUGINS`` for the runner, from vLLM's plugin entry points as (name,
    value): every plugin but kvoffload's, or None (leave it unset) when kvoffload has
    none. With ``<repo>/src`` on the path, an editable install's ``.egg-info`` there
    would otherwise register kvoffload's plugin in LMCache's venv."""
    eps = list(entry_points)
    if not any(value.split(".", 1)[0] == "kvoffload" for _, value in eps):
        return None
    return ",".join(sorted({n for n, v in eps if v.split(".", 1)[0] != "kvoffload"}))


def one_line(text: str, limit: int = 300) -> str:
    """The last non-blank line of ``text``, shortened (a failure's reason)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else "no output"


def runner_env(base: Mapping[str, str]) -> dict[str, str]:
    """The runner's environment: kvoffload's sources and bench/ importable, nothing of
    kvoffload's own venv (no VIRTUAL_ENV, no PYTHONPATH of the caller)."""
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join((str(REPO / "src"), str(RUNNER.parent)))
    env["LMCACHE_DISABLE_BANNER"] = "1"
    env["LMCACHE_TRACK_USAGE"] = "false"  # no usage reports (nothing to reach anyway)
    return env


def run_peer(
    python: Path, job: Mapping[str, Any], workdir: Path, timeout_s: float = 1800.0
) -> tuple[RunResult, dict[str, float]]:
    """Run one LMCache job in a subprocess of ``python``; PeerFailed with the reason
    (the runner's last line) when it produced no result."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "job.json", workdir / "out.json", workdir / "log"
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    with log_path.open("w") as log:
        # A process group of its own: on a timeout the runner and the server it
        # started (same group) are killed together, by the group's id.
        proc = subprocess.Popen(
            [str(python), str(RUNNER), str(job_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=runner_env(os.environ),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise PeerFailed(f"runner timed out after {timeout_s:.0f} s") from exc
    if proc.returncode != 0 or not out_path.exists():
        reason = one_line(log_path.read_text(errors="replace"))
        raise PeerFailed(f"runner exit {proc.returncode}: {reason}")
    return parse_result(json.loads(out_path.read_text()))


if __name__ == "__main__":
    sys.exit("a library of bench/e2e_tiers.py and bench/lmcache_runner.py")
