"""The "tiers" workload of ``bench/e2e.py``: kvoffload's host, disk and Redis tiers
against an engine that never evicts.

Workload: the demo's chat (``kvoffload.workload.chat``), 16 users x 6 turns, a
256-token system prompt, 32-64-token messages, 16-token answers, on the demo model
(float32, greedy; ``--quick``: the 2-layer ``tiny`` model, 16 users x 2 turns, 128-token
system prompt). Every engine runs at most :data:`MAX_RUNNING` requests at once, so
concurrency is the same everywhere and only the cache differs. A "small" engine's KV
cache holds :data:`KV_REQUESTS` of the longest requests (about 30% of all histories).

Configurations (fresh in-process engine per run, runs interleaved):

- ``never-evicting``: no connector, a KV cache that holds every history (the limit,
  and the reference for outputs and ratios; always run);
- ``host-big``: kvoffload, host tier of twice the working set (as the demo sizes it);
- ``host10+disk``: kvoffload, host tier of 10% of the working set, disk tier (a fresh
  directory per run under ``--dir``) of twice the working set;
- ``host10+redis``: kvoffload, host 10%, Redis tier on a private redis-server on a
  free loopback port (``maxmemory`` 4x the working set, allkeys-lru), FLUSHALL before
  every run so each starts cold, killed by pid at the end;
- ``no-offload``: small engine, no connector;
- ``vllm-offload``: vLLM's OffloadingConnector (``vllm_cpu_offload_spec.py``) with
  host-big's capacity;
- ``lmcache``: LMCache 0.5.6 in multiprocess mode (``lmcache server`` + vLLM's
  ``LMCacheMPConnector``), L1 = host-big's bytes, chunks of one engine block;
- ``lmcache10+disk``: the same with L1 = host10's bytes (raised to the smallest L1
  that holds the longest request's chunks, which LMCache needs to store it at all:
  :meth:`TierSetup.lmcache_small`) and its ``fs`` L2 adapter in a fresh directory.
  Both run in LMCache's own venv (``bench/lmcache_env.py``), one subprocess per run
  (``bench/lmcache_peer.py``, ``bench/lmcache_runner.py``), on the small engine; when
  that venv cannot be set up they are reported as failed and the others run on.

Baselines, measured once per round before its engines: the dd-like sequential
O_DIRECT write/read of ``tier_baselines.sequential_direct`` at the chunk size, and
``redis-benchmark`` (``tier_baselines.redis_benchmark``: SET on new keys, GET of one
key, value = 64-byte header + chunk, ``-c`` = tier threads, ``-P`` = ``--redis-pipeline``).
"""

from __future__ import annotations

import shutil
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmcache_env
import lmcache_peer
from e2e_metrics import GB, Counts, run_counted
from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.core.config.options import OPTIONS
from kvoffload.demos.chat_demo import BLOCK, kvoffload_config
from kvoffload.demos.tiny_model import PRESETS, ensure_model, kv_bytes_per_token
from kvoffload.demos.vllm_runner import EngineSpec, RunResult, turn_batches
from kvoffload.workload.chat import ChatWorkload
from tier_baselines import redis_benchmark, sequential_direct

CONFIGS = (
    "never-evicting",
    "host-big",
    "host10+disk",
    "host10+redis",
    "no-offload",
    "vllm-offload",
    "lmcache",
    "lmcache10+disk",
)
KVOFFLOAD = ("host-big", "host10+disk", "host10+redis")
LMCACHE = ("lmcache", "lmcache10+disk")
REFERENCE = "never-evicting"
MAX_RUNNING = 4
KV_REQUESTS = 4.5  # a small engine's KV cache: this many of the longest requests
HOST_SMALL = 0.10  # host10: this share of the working set
MiB = 1 << 20
TIER_THREADS = next(o.default for o in OPTIONS if o.name == "tier_threads")


def blocks(tokens: float) -> int:
    """``tokens`` rounded up to whole blocks, plus vLLM's null block."""
    return -(-int(tokens) // BLOCK) * BLOCK + BLOCK


@dataclass(frozen=True)
class TierSetup:
    preset: str
    workload: ChatWorkload
    runs: int
    root: Path  # a directory on a real disk, removed by the caller
    disk_o_direct: bool = False
    redis_pipeline: int = 1

    @property
    def token_bytes(self) -> int:
        return kv_bytes_per_token(self.preset)

    @property
    def chunk_bytes(self) -> int:
        return BLOCK * self.token_bytes  # one chunk = one engine block (chunk_tokens unset)

    def longest(self) -> int:
        return max(len(r.prompt) + r.output_tokens for r in self.workload.requests())

    def small_tokens(self) -> int:
        return blocks(KV_REQUESTS * self.longest())

    def big_tokens(self) -> int:
        return blocks(self.workload.working_set_tokens() + 2 * self.longest())

    def working_bytes(self) -> int:
        return self.workload.working_set_tokens() * self.token_bytes

    def host_big(self) -> int:
        return 2 * self.working_bytes()

    def host_small(self) -> int:
        return max(int(HOST_SMALL * self.working_bytes()), self.chunk_bytes)

    def lmcache_small(self) -> int:
        """lmcache10+disk's L1: host10's bytes, or the longest request's chunks if more
        (a store of a request's chunks fails when L1 cannot hold them all at once)."""
        return max(self.host_small(), -(-self.longest() // BLOCK) * self.chunk_bytes)

    def lmcache_l1(self, config: str) -> int:
        return self.host_big() if config == "lmcache" else self.lmcache_small()

    def redis_maxmemory(self) -> int:
        """The private redis-server's ``maxmemory`` (bytes; allkeys-lru beyond it)."""
        return 4 * self.working_bytes() + 256 * MiB

    def baseline_chunks(self) -> int:
        chunks = self.working_bytes() // self.chunk_bytes
        return max(64, min(max(256, chunks), (128 * MiB) // self.chunk_bytes))

    def engine(self, config: str, run: int, redis_url: str | None) -> EngineSpec:
        from vllm_cpu_offload_spec import spec_config  # imports torch: after logging set-up

        transfer: dict[str, Any] | None = None
        if config == "host-big":
            transfer = kvoffload_config(self.host_big())
        elif config.startswith("host10"):
            transfer = kvoffload_config(self.host_small())
            extra = transfer["kv_connector_extra_config"]
            if config.endswith("disk"):
                extra["disk_path"] = str(self.root / f"disk-{run}")
                extra["disk_bytes"] = self.host_big()
                extra["disk_o_direct"] = self.disk_o_direct
            else:
                if redis_url is None:
                    raise RuntimeError("no redis-server")
                extra["redis_url"] = redis_url
        elif config == "vllm-offload":
            transfer = spec_config(self.host_big())
        tokens = self.big_tokens() if config == REFERENCE else self.small_tokens()
        return EngineSpec(
            model=ensure_model(self.preset),
            kv_cache_memory_bytes=tokens * self.token_bytes,
            block_size=BLOCK,
            max_model_len=min(
                self.small_tokens() - BLOCK, PRESETS[self.preset].max_position_embeddings
            ),
            max_num_seqs=MAX_RUNNING,
            kv_transfer_config=transfer,
        )


def make_setup(
    quick: bool, runs: int | None, users: int | None, turns: int | None, root: Path, **kw: Any
) -> TierSetup:
    preset = "tiny" if quick else "demo"
    vocab = PRESETS[preset].vocab_size
    if quick:
        chat = ChatWorkload(users or 16, turns or 2, 128, (32, 96), 8, vocab=vocab, seed=7)
    else:
        chat = ChatWorkload(users or 16, turns or 6, 256, (32, 64), 16, vocab=vocab, seed=7)
    return TierSetup(preset, chat, runs or (1 if quick else 3), root, **kw)


# --- the runs --------------------------------------------------------------------

Rate = tuple[float, float]  # (chunks/s, GB/s)


@dataclass
class Results:
    configs: tuple[str, ...]
    runs: dict[str, list[RunResult]] = field(default_factory=dict)
    counts: dict[str, list[Counts]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    peer_counts: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # LMCache's
    baselines: list[dict[str, Rate]] = field(default_factory=list)  # one per round


def baseline_round(setup: TierSetup, server: Any, configs: Sequence[str]) -> dict[str, Rate]:
    """This round's dd-like disk and redis-benchmark rates (those the configs need)."""
    out: dict[str, Rate] = {}
    chunk, count = setup.chunk_bytes, setup.baseline_chunks()
    if "host10+disk" in configs:
        write_s, read_s = sequential_direct(setup.root / "dd-like.bin", chunk, count)
        out["disk write"] = (count / write_s, count * chunk / GB / write_s)
        out["disk read"] = (count / read_s, count * chunk / GB / read_s)
    if "host10+redis" in configs and server is not None:
        value, clients, pipe = HEADER_BYTES + chunk, TIER_THREADS, setup.redis_pipeline
        admin = server.client(socket_timeout=30)
        try:
            new = redis_benchmark(
                server.port, value, clients, pipe, count, tests="set", fresh_keys=True
            )
            admin.flushall()
            one = redis_benchmark(server.port, value, clients, pipe, count, tests="get")
            admin.flushall()
        finally:
            admin.close()
        out["redis SET"] = (new["SET"], new["SET"] * value / GB)
        out["redis GET"] = (one["GET"], one["GET"] * value / GB)
    return out


def start_redis(setup: TierSetup) -> Any:
    from kvoffload.testing.redis_server import RedisServer

    extra = ("--maxmemory", str(setup.redis_maxmemory()), "--maxmemory-policy", "allkeys-lru")
    return RedisServer(setup.root / "redis", extra=extra).start()


def run_lmcache(
    setup: TierSetup, config: str, run: int, python: Path, batches: Sequence[Sequence[Any]]
) -> tuple[RunResult, dict[str, float]]:
    """One LMCache run on the small engine, in a subprocess of LMCache's venv."""
    spec = setup.engine("no-offload", run, None)
    l2 = setup.root / f"lmcache-l2-{run}" if config.endswith("disk") else None
    job = lmcache_peer.job(spec, batches, setup.lmcache_l1(config), l2, BLOCK)
    work = setup.root / f"{config}-{run}"
    try:
        return lmcache_peer.run_peer(python, job, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if l2 is not None:
            shutil.rmtree(l2, ignore_errors=True)


def lmcache_python(res: Results) -> Path | None:
    """LMCache's venv python (built on first use); None, with the LMCache configs
    marked failed, when it cannot be set up."""
    if not set(LMCACHE) & set(res.configs):
        return None
    print("  tiers: LMCache's venv (bench/lmcache_env.py)...", flush=True)
    try:
        return lmcache_env.ensure()
    except lmcache_env.Unavailable as exc:
        for c in LMCACHE:
            if c in res.configs:
                res.failed[c] = f"failed: LMCache's venv: {exc}"
        return None


def measure(setup: TierSetup, configs: Sequence[str]) -> Results:
    """``setup.runs`` rounds: this round's baselines, then one run of every config."""
    configs = (REFERENCE, *[c for c in CONFIGS if c in configs and c != REFERENCE])
    res = Results(configs, {c: [] for c in configs}, {c: [] for c in configs})
    res.peer_counts = {c: [] for c in configs if c in LMCACHE}
    batches = turn_batches(setup.workload.requests())
    server = None
    python = lmcache_python(res)
    try:
        if "host10+redis" in configs:
            try:
                server = start_redis(setup)
            except Exception as exc:
                res.failed["host10+redis"] = f"redis-server: {type(exc).__name__}: {exc}"
        for i in range(setup.runs):
            try:
                res.baselines.append(baseline_round(setup, server, configs))
            except Exception as exc:  # a baseline is context: report it, measure on
                print(f"  tiers round {i + 1}: baselines failed: {type(exc).__name__}: {exc}")
            for config in configs:
                if config in res.failed:
                    continue
                if server is not None and config == "host10+redis":
                    admin = server.client()
                    admin.flushall()  # every run starts cold
                    admin.close()
                start = time.perf_counter()
                counts: Counts | None = None
                try:
                    if config in LMCACHE:
                        assert python is not None  # else failed above
                        result, peer = run_lmcache(setup, config, i, python, batches)
                        res.peer_counts[config].append(peer)
                    else:
                        spec = setup.engine(config, i, server.url if server else None)
                        result, counts = run_counted(spec, batches)
                except Exception as exc:
                    traceback.print_exc()
                    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
                    res.failed[config] = f"failed: {reason[:300]}"
                    print(f"  tiers run {i + 1}/{setup.runs} {config}: {res.failed[config]}")
                    continue
                finally:
                    shutil.rmtree(setup.root / f"disk-{i}", ignore_errors=True)
                res.runs[config].append(result)
                if counts is not None:
                    res.counts[config].append(counts)
                took = time.perf_counter() - start
                print(
                    f"  tiers run {i + 1}/{setup.runs} {config}: {took:.0f} s, mean TTFT "
                    f"{result.mean_ttft_s:.3f} s, connector hits {result.external_hit_tokens}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.kill()
    return res
