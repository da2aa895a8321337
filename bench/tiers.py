"""Disk and Redis tier throughput against their baselines, and the chat e2e with a disk tier.

Disk (``--dir``, default a fresh directory under /var/tmp; it must be a real disk,
the filesystem is printed): chunks of ``--chunk-kib`` (default 256 KiB and 2 MiB),
``--disk-mib`` in all, spilled from a :class:`~kvoffload.tiers.host.HostSlab` to the
disk tier and promoted back through :class:`TierWorker` with real SPILL / PROMOTE
jobs of about ``--job-mib`` each, all submitted at once on the worker's production
pool (its default thread count). Promotion verifies every chunk (header, xxh3); the
bench then checks the bytes. Both ``o_direct`` settings: buffered writes land in the
page cache (no fsync, as in the store); buffered reads start cold (each file is
fdatasync'ed and dropped with ``POSIX_FADV_DONTNEED`` first, outside the timing).
Baseline in the same run: one file written then read sequentially with O_DIRECT from
a page-aligned buffer of the chunk size, one request in flight, no fsync ("dd-like");
GNU ``dd oflag=direct`` / ``iflag=direct`` is shown too. Target: kvoffload O_DIRECT
write and read >= 0.7x the dd-like baseline.

Redis: a private redis-server (no persistence) per chunk size. Baseline
``redis-benchmark`` with the tier's value size (64-byte header + chunk), ``-c`` = the
tier threads and ``-P`` = chunks per job (one pipelined round trip per job): SET with
``-r 10^9``, so that every SET creates a new key as the tier's spills do (the server
allocates every value; the run checks DBSIZE), and GET of one stored key. The "one
key" row, SET overwriting a single key in place (no allocation, several times
faster), is shown for reference. Then the tier's write (spill) and read (promote)
through TierWorker and :class:`RedisStore`; FLUSHALL between phases. Server and
clients share this machine's cores. Target: >= 0.5x redis-benchmark's SET (new
keys) / GET.

GB/s counts 1e9 chunk bytes per second (payload for disk, payload + header for
Redis, as redis-benchmark counts its values). Runs are repeated (``--runs``);
ratios are taken per run against that run's baseline; medians are printed.

e2e: the chat workload of ``bench/e2e.py`` on in-process vLLM, with kvoffload's host
tier at a quarter of what e2e.py gives it (half the working set), without and with a
disk tier that holds everything, and with no offload; fresh engine per run,
configurations interleaved, medians; greedy outputs must equal no offload's.

Usage: ``python bench/tiers.py [--quick] [--runs N] [--no-e2e | --e2e-only]``.
Exit code 1 only on errors or wrong bytes/outputs, never for a missed target.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.core.jobs import JobKind, TierJob
from kvoffload.core.keys import ChunkKey, Namespace
from kvoffload.inspection.disk_scan import inspect_disk
from tier_baselines import (
    Run,
    Times,
    evict_page_cache,
    filesystem,
    real_dd,
    redis_benchmark,
    sequential_direct,
    throughput_table,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvoffload.testing.redis_server import RedisServer

if TYPE_CHECKING:
    from kvoffload.demos.vllm_runner import RunResult
    from kvoffload.tiers.host import HostSlab
    from kvoffload.transfer.tier_worker import TierStore, TierWorker

MiB = 1 << 20
DIGEST = Namespace("bench/tiers", "bytes", "uint8").digest()
JOB_IDS = itertools.count(1)


class BenchError(RuntimeError):
    """Wrong bytes or a failed job: the measurement is invalid."""


def tier_threads() -> int:
    """The thread count the engine's tier lane runs with (TierWorker's default)."""
    import inspect

    from kvoffload.transfer.tier_worker import TierWorker

    return int(inspect.signature(TierWorker).parameters["threads"].default)


def filled_slab(chunk_bytes: int, total_bytes: int) -> tuple[HostSlab, list[int]]:
    """A slab of random chunks and each slot's xxh3 (to check promoted bytes)."""
    from kvoffload.tiers.host import HostSlab

    slab = HostSlab(chunk_bytes, total_bytes)
    fill(slab)
    return slab, slot_digests(slab)


def fill(slab: HostSlab) -> None:
    """The same pseudo-random bytes every time (a failed promotion's slab is refilled)."""
    flat = slab.data.view(-1).numpy()
    rng = np.random.default_rng(1)
    for start in range(0, len(flat), 64 * MiB):  # in pieces: bounded extra memory
        piece = flat[start : start + 64 * MiB]
        piece[:] = np.frombuffer(rng.bytes(len(piece)), dtype=np.uint8)


def slot_digests(slab: HostSlab) -> list[int]:
    return [xxhash.xxh3_64_intdigest(slab.slot_bytes(s)) for s in range(slab.num_slots)]


def move(
    worker: TierWorker, kind: JobKind, tier: str, keys: Sequence[ChunkKey], per_job: int
) -> float:
    """Seconds to run SPILL or PROMOTE jobs of ``per_job`` chunks over every slot
    (slot i holds keys[i]), all submitted at once, as the engine's plans would."""
    jobs = [
        TierJob(
            job_id=next(JOB_IDS),
            kind=kind,
            keys=tuple(keys[i : i + per_job]),
            slots=tuple(range(i, min(i + per_job, len(keys)))),
            tier=tier,
            tier_slots=tuple(range(i, min(i + per_job, len(keys)))),  # slot i -> tier slot i
            request_id="bench" if kind is JobKind.PROMOTE else None,  # a spill serves none
        )
        for i in range(0, len(keys), per_job)
    ]
    begin = time.perf_counter()
    for job in jobs:
        worker.submit(job)
    if not worker.wait([j.job_id for j in jobs], timeout=600):
        raise BenchError(f"{kind.value} jobs on {tier} still running after 600 s")
    seconds = time.perf_counter() - begin
    results = worker.poll()
    bad = [r for r in results if not r.success or r.failed_chunks]
    if bad or len(results) != len(jobs):
        first = "results missing"
        if bad:
            index, failure = bad[0].failed_chunks[0] if bad[0].failed_chunks else (0, "")
            first = str(bad[0].error or (index, str(failure)))
        raise BenchError(f"{kind.value}: {len(bad)} of {len(jobs)} jobs failed, e.g. {first}")
    return seconds


def round_trip(
    slab: HostSlab,
    digests: list[int],
    tier: str,
    store: TierStore,
    per_job: int,
    *,
    between: Callable[[], None] = lambda: None,
) -> Run:
    """Spill every slot to ``store`` under fresh keys, zero the slab, promote them
    back and check the bytes; a phase that fails has no time and names its error.
    ``between`` runs untimed after the spill."""
    from kvoffload.transfer.tier_worker import TierWorker

    keys = [ChunkKey(os.urandom(16)) for _ in range(slab.num_slots)]
    worker = TierWorker(slab, {tier: store})
    write_s: float | None = None
    read_s: float | None = None
    error = ""
    try:
        write_s = move(worker, JobKind.SPILL, tier, keys, per_job)
        between()
        slab.data.zero_()
        read_s = move(worker, JobKind.PROMOTE, tier, keys, per_job)
        if slot_digests(slab) != digests:
            raise BenchError(f"{tier}: promoted bytes differ from the spilled ones")
    except BenchError as exc:
        error = str(exc)
    finally:
        worker.shutdown()
    if error:
        fill(slab)  # restore what the failed promotion left behind
        return Run(write_s, None, error)
    return Run(write_s, read_s)


def disk_runs(root: Path, slab: HostSlab, digests: list[int], per_job: int, runs: int) -> Times:
    from kvoffload.tiers.disk import DiskStore
    from kvoffload.tiers.disk_store import DiskTierStore

    payload, count = slab.chunk_bytes, slab.num_slots
    times: Times = {}
    for run in range(runs):
        base = sequential_direct(root / "baseline.bin", payload, count)
        times.setdefault("dd-like O_DIRECT", []).append(Run(*base))
        dd = real_dd(root / "dd.bin", payload, count)
        times.setdefault("GNU dd O_DIRECT", []).append(Run(*dd) if dd else Run(None, None, "dd"))
        for o_direct in (True, False):
            tier_root = root / f"tier-{run}-{o_direct}"
            # The slab is created and preallocated here, untimed: the engine does it
            # once at start.
            store = DiskStore(tier_root, DIGEST, 0, payload, count, o_direct=o_direct)

            def evict(store: DiskStore = store) -> None:
                evict_page_cache(store.path)

            try:
                tier = DiskTierStore(store)
                spent = round_trip(slab, digests, "disk", tier, per_job, between=evict)
            finally:
                store.close()
                shutil.rmtree(tier_root, ignore_errors=True)
            if o_direct and not store.o_direct:
                print("  the filesystem refused O_DIRECT: the store fell back to buffered I/O")
            label = "kvoffload O_DIRECT" if o_direct else "kvoffload buffered"
            times.setdefault(label, []).append(spent)
        print(f"  disk {payload >> 10} KiB run {run + 1}/{runs} done", flush=True)
    return times


def redis_runs(workdir: Path, slab: HostSlab, digests: list[int], per_job: int, runs: int) -> Times:
    from kvoffload.tiers.redis_client import RedisSettings, make_client
    from kvoffload.tiers.redis_store import RedisStore

    payload, count = slab.chunk_bytes, slab.num_slots
    value = HEADER_BYTES + payload
    times: Times = {"redis-benchmark": [], "redis-benchmark one key": [], "kvoffload": []}
    memory = ("--maxmemory", str(2 * count * value + 256 * MiB), "--maxmemory-policy", "noeviction")
    server = RedisServer(workdir / "redis", extra=memory).start()
    try:
        admin = server.client(socket_timeout=30)
        for run in range(runs):
            one = redis_benchmark(server.port, value, tier_threads(), per_job, count)
            admin.flushall()
            new = redis_benchmark(
                server.port, value, tier_threads(), per_job, count, tests="set", fresh_keys=True
            )
            if admin.dbsize() < 0.99 * count:  # a few random keys may collide
                raise BenchError(f"redis-benchmark -r wrote {admin.dbsize()} keys, not {count}")
            admin.flushall()
            times["redis-benchmark"].append(Run(count / new["SET"], count / one["GET"]))
            times["redis-benchmark one key"].append(Run(count / one["SET"], count / one["GET"]))
            client = make_client(RedisSettings(url=server.url))  # the connector's defaults
            store = RedisStore(client, DIGEST, 0, payload)
            try:
                times["kvoffload"].append(round_trip(slab, digests, "redis", store, per_job))
            finally:
                client.close()
                admin.flushall()
            print(f"  redis {payload >> 10} KiB run {run + 1}/{runs} done", flush=True)
        admin.close()
    finally:
        server.kill()
    return times


def micro(args: argparse.Namespace, root: Path) -> tuple[list[str], list[str]]:
    """The disk and Redis parts; returns the closing summary lines and kvoffload's errors."""
    threads, summary, errors = tier_threads(), [], []
    fs, free = filesystem(root), shutil.disk_usage(root).free
    print(f"disk: {fs} (at {root}); tier threads {threads}; {os.cpu_count()} CPUs")
    if fs.split()[1] in ("tmpfs", "ramfs") or free < 3 * args.disk_mib * MiB:
        raise BenchError(f"--dir needs a real disk with {3 * args.disk_mib} MiB free: {fs}")
    for kib in args.chunk_kib:
        chunk = kib << 10
        per_job = max(1, (args.job_mib * MiB) // chunk)
        for part, mib in (("disk", args.disk_mib), ("redis", args.redis_mib)):
            if part not in args.parts:
                continue
            slab, digests = filled_slab(chunk, max(mib * MiB, chunk))
            count = slab.num_slots
            head = (
                f"\n{part}: {count} chunks of {kib} KiB ({count * chunk / MiB:.0f} MiB), "
                f"jobs of {per_job} chunks on {threads} threads, medians of {args.runs} runs"
            )
            if part == "disk":
                times = disk_runs(root, slab, digests, per_job, args.runs)
                table = throughput_table(
                    times, "dd-like O_DIRECT", count * chunk, {"kvoffload O_DIRECT": 0.7}
                )
            else:
                times = redis_runs(root, slab, digests, per_job, args.runs)
                head += (
                    f"\n  redis-benchmark -d {HEADER_BYTES + chunk} -c {threads} -P {per_job} "
                    f"-n {count} (SET: -r 10^9, new keys); server and client share the "
                    f"{os.cpu_count()} CPUs"
                )
                value = count * (HEADER_BYTES + chunk)
                table = throughput_table(times, "redis-benchmark", value, {"kvoffload": 0.5})
            del slab
            print(head + "\n" + "\n".join(table), flush=True)
            summary += [f"{part} {kib} KiB:", *table[1:]]
            errors += [line for line in table if line.startswith("  error in kvoffload")]
    return summary, errors


E2E_CONFIGS = ("no-offload", "host 1/4", "host 1/4 + disk")


def e2e(args: argparse.Namespace, root: Path) -> tuple[list[str], bool]:
    """The chat workload under a small host tier; returns (summary lines, outputs ok)."""
    from e2e import med, same_outputs
    from kvoffload.demos.chat_demo import kvoffload_config
    from kvoffload.demos.chat_demo import make_setup as make_chat_setup
    from kvoffload.demos.tiny_model import ensure_model
    from kvoffload.demos.vllm_runner import run, turn_batches

    setup = make_chat_setup(args.quick, None, None)
    ensure_model(setup.preset)
    host, disk_bytes = setup.host_bytes() // 4, setup.host_bytes()
    batches = turn_batches(setup.workload.requests())
    runs = args.e2e_runs or (1 if args.quick else 3)
    results: dict[str, list[RunResult]] = {c: [] for c in E2E_CONFIGS}
    disk_chunks: list[int] = []
    for i in range(runs):
        for config in E2E_CONFIGS:
            transfer: dict[str, Any] | None = None
            disk = root / f"e2e-disk-{i}"
            if config != "no-offload":
                transfer = kvoffload_config(host)
            if config.endswith("disk") and transfer is not None:
                extra = {"disk_path": str(disk), "disk_bytes": disk_bytes}
                extra["disk_o_direct"] = args.e2e_o_direct
                transfer["kv_connector_extra_config"].update(extra)
            start = time.perf_counter()
            try:
                results[config].append(run(setup.engine(transfer), batches))
                if disk.exists():  # chunks the slab holds, as kvoffload inspect counts them
                    report = inspect_disk(disk, None, verify=False, world_size=None)
                    disk_chunks.append(sum(ns.complete_chunks for ns in report.namespaces))
            finally:
                shutil.rmtree(disk, ignore_errors=True)
            took = time.perf_counter() - start
            print(f"  e2e run {i + 1}/{runs} {config}: {took:.0f} s", flush=True)
    w = setup.workload
    ws = w.working_set_tokens()
    lines = [
        f"e2e chat ({setup.preset!r}): {w.users} users x {w.turns} turns, working set {ws} "
        f"tokens, engine KV {setup.kv_cache_tokens()} tokens; host tier {host / MiB:.1f} MiB "
        f"(half the working set), disk tier {disk_bytes / MiB:.1f} MiB, O_DIRECT "
        f"{args.e2e_o_direct}; {runs} run(s), medians; disk held {max(disk_chunks, default=0)} "
        "chunks at the end",
        f"  {'config':<18}{'mean TTFT':>10}{'p90':>9}{'gen tok/s':>11}{'connector hits':>16}"
        f"{'/ no offload':>14}{'/ host 1/4':>12}{'same tokens':>13}",
    ]
    base, ok = results["no-offload"][0], True
    ttft = {c: med(results[c], lambda r: r.mean_ttft_s) for c in E2E_CONFIGS}
    for config in E2E_CONFIGS:
        rs = results[config]
        ok &= all(same_outputs(base, r) == f"{len(r.requests)}/{len(r.requests)}" for r in rs)
        lines.append(
            f"  {config:<18}{ttft[config]:>9.3f}s"
            f"{med(rs, lambda r: r.ttft_percentile(0.9)):>8.3f}s"
            f"{med(rs, lambda r: r.generated_tok_s):>11.1f}"
            f"{med(rs, lambda r: float(r.external_hit_tokens)):>16.0f}"
            f"{ttft[config] / ttft['no-offload']:>13.2f}x{ttft[config] / ttft['host 1/4']:>11.2f}x"
            f"{same_outputs(base, rs[0]):>13}"
        )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 runs, e2e quick")
    parser.add_argument("--runs", type=int, default=None, help="disk/redis runs (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="disk directory (a real disk)")
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--disk-mib", type=int, default=None, help="default 256 (quick 64)")
    parser.add_argument("--redis-mib", type=int, default=None, help="default 512 (quick 64)")
    parser.add_argument("--job-mib", type=int, default=4, help="bytes per tier job")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--no-e2e", action="store_true", help="skip the (slow) e2e part")
    parts.add_argument("--e2e-only", action="store_true", help="only the e2e part")
    parser.add_argument("--e2e-runs", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--e2e-o-direct", action="store_true", help="disk_o_direct in e2e")
    parser.add_argument("--skip-redis", action="store_true", help="no Redis part")
    args = parser.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 5)
    args.disk_mib = args.disk_mib or (64 if args.quick else 256)
    args.redis_mib = args.redis_mib or (64 if args.quick else 512)
    args.parts = ["disk"] + ([] if args.skip_redis else ["redis"])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is first imported

    base = args.dir or Path("/var/tmp" if Path("/var/tmp").is_dir() else ".")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvoffload-bench-tiers-", dir=base))
    started, summary, ok = time.perf_counter(), [], True
    try:
        if not args.e2e_only:
            lines, errors = micro(args, root)
            summary += lines
            ok = not errors
        if not args.no_e2e:
            lines, same = e2e(args, root)
            ok &= same
            print("\n" + "\n".join(lines))
            summary += lines
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nsummary (medians; ratios per run against the same run's baseline):")
    print("\n".join(summary))
    if not ok:
        print("ERROR: kvoffload failed (errors above) or its greedy outputs differ")
    print(f"\nbenchmark took {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    import logging
    import warnings

    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    sys.exit(main())
