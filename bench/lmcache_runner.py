"""One LMCache run of the e2e "tiers" workload, in LMCache's own venv.

Run by ``bench/lmcache_peer.run_peer`` as ``<lmcache venv>/bin/python
bench/lmcache_runner.py JOB.json OUT.json`` with ``PYTHONPATH=<repo>/src:<repo>/bench``
(kvoffload is not installed in that venv; should ``src/`` hold an editable install's
metadata, its vLLM plugin is still left out, :func:`without_kvoffload_plugin`):

1. starts ``lmcache server`` (``lmcache_peer.server_command``) on free loopback ports,
   its output in ``server.log`` next to the job, in the runner's process group;
2. waits until its ``/healthcheck`` answers and its ``/metrics`` can be read (a
   bounded poll, :data:`READY_S`);
3. builds the engine from the job's EngineSpec with ``kv_connector:
   LMCacheMPConnector`` through ``kvoffload.demos.vllm_runner`` (the same path and
   settings as every other configuration), warms it up, reads the server's
   counters, runs the batches, reads them again;
4. writes the result JSON; the server is stopped by its pid on every path.

vLLM's start scans every module's globals (``_rebind_kernels`` in
``vllm/triton_utils/dispatcher.py``) and reads ``vars(value)`` of each object that
has a ``__dict__``; LMCache imports numba, whose llvmlite library loader answers any
attribute, ``__dict__`` included, with a wrapped C function, which breaks that scan
(``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``).
:func:`patch_llvmlite_loader` makes the loader refuse dunder names (they are never C
functions), in this process only; no installed file is changed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import lmcache_peer as peer

READY_S = 120.0
STOP_S = 20.0


def patch_llvmlite_loader() -> None:
    """llvmlite's library loader: AttributeError for dunder names instead of a C lookup."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    loader = type(ffi.lib)
    original = loader.__getattr__
    if getattr(original, "_kvoffload_patched", False):
        return

    def getattr_(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    getattr_._kvoffload_patched = True  # type: ignore[attr-defined]
    loader.__getattr__ = getattr_


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((peer.HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_get(url: str, timeout_s: float = 2.0) -> str | None:
    """The body of a 200 answer, None on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def read_counters(http_port: int) -> dict[str, float]:
    text = http_get(f"http://{peer.HOST}:{http_port}/metrics", timeout_s=10.0)
    if text is None:
        raise peer.PeerFailed("lmcache server /metrics did not answer")
    return peer.parse_metrics(text)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server by pid, SIGKILL it if it is still running after STOP_S."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def without_kvoffload_plugin() -> None:
    """Keep kvoffload's vLLM plugin out of this process (``lmcache_peer.allowed_plugins``)."""
    from importlib.metadata import distributions

    eps = [
        (e.name, e.value)
        for d in distributions()
        for e in d.entry_points
        if e.group.startswith("vllm.")
    ]
    allowed = peer.allowed_plugins(eps)
    if allowed is not None:
        os.environ["VLLM_PLUGINS"] = allowed


def run(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    without_kvoffload_plugin()
    patch_llvmlite_loader()
    from kvoffload.demos.vllm_runner import open_engine, run_batches, warm_up

    port, http_port = free_ports(2)
    lmcache = Path(sys.executable).with_name("lmcache")
    cmd = peer.server_command(
        lmcache,
        port,
        http_port,
        l1_bytes=job["l1_bytes"],
        chunk_tokens=job["chunk_tokens"],
        l2_dir=job["l2_dir"],
    )
    if job["l2_dir"] is not None:
        Path(job["l2_dir"]).mkdir(parents=True, exist_ok=True)
    with (workdir / "server.log").open("w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            health = http_get(f"http://{peer.HOST}:{http_port}/healthcheck")
            metrics = http_get(f"http://{peer.HOST}:{http_port}/metrics")
            return health is not None and metrics is not None

        try:
            waited = peer.wait_ready(ready, lambda: server.poll() is None, READY_S)
        except peer.PeerFailed as exc:
            why = peer.one_line((workdir / "server.log").read_text(errors="replace"))
            raise peer.PeerFailed(f"{exc}: {why}") from exc
        print(f"lmcache server ready after {waited:.1f} s (pid {server.pid})", flush=True)
        spec = peer.engine_spec(job, peer.connector_config(port))
        with open_engine(spec) as llm:
            warm_up(llm)
            before = read_counters(http_port)
            result = run_batches(llm, peer.job_batches(job))
            after = read_counters(http_port)
        return peer.result_json(result, peer.grown(before, after))
    finally:
        stop(server)


def main(argv: list[str]) -> int:
    job_path, out_path = Path(argv[1]), Path(argv[2])
    job = json.loads(job_path.read_text())
    try:
        out = run(job, job_path.parent)
    except peer.PeerFailed as exc:
        print(f"failed: {exc}", flush=True)
        return 1
    out_path.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
