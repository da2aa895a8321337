"""Data-parallel replicas on one node: one node-shared host tier vs private ones.

N real vLLM engines (``engine_process.Engine``: separate processes, in-process ``LLM``
each, CPU, float32, greedy) serve a chat workload round-robin: U users (U coprime to
N, so a user's next turn lands on another replica), each turn's prompt = a shared
system prompt + the user's messages so far. Runs with the same requests:

- ``reference``: one engine, no offload (the outputs every other run must match);
  then ``--rounds`` rounds (default 3) of, in alternating order:
- ``shared``: N engines on one ``host_share`` of S bytes (a new, empty share each
  round);
- ``private``: N engines with a private host tier of S/N bytes each (same total).

With ``--disk-chunks D`` every engine also has a disk tier: in ``shared``, one disk
tier of D chunks that the engines share (decision 0017: under a host share, engines
naming one ``disk_path`` share it through a node process of its own); in
``private``, a disk tier of D/N chunks per engine, each in its own directory. Give
a ``--share-chunks`` below the working set so that chunks leave host memory.

Each engine first answers one untimed prompt shorter than a chunk (its first forward
pass is slow). Each request is sent to its replica and answered alone (``max_tokens`` 1: the
request's latency is its time to first token, measured in the engine process around
``generate``); after it the engine drains its stores (not timed), so the next
replica finds them, as a steady stream of later requests would. Prints the mean
TTFT of each run, the median over rounds of the ratio shared/private (issue 24's
target: <= 0.7), and whether every run's tokens equal the reference's.

    PYTHONPATH=src nice -n 19 python bench/share_engines.py [--engines 2] [--preset demo]
        [--share-chunks S --disk-chunks D]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_process import BLOCK, Engine

# ---------------------------------------------------------------- the workload


def chat_requests(users: int, turns: int, system: int, message: int, vocab: int) -> list[Any]:
    """(user, turn, prompt) in serving order: turn by turn, user by user."""
    system_prompt = [(11 * i) % (vocab - 3) + 3 for i in range(system)]
    out = []
    for turn in range(turns):
        for user in range(users):
            history: list[int] = []
            for t in range(turn + 1):
                seed = 1000 * user + 17 * t + 5
                history += [(seed + 7 * i) % (vocab - 3) + 3 for i in range(message)]
            out.append((user, turn, system_prompt + history))
    return out


def serve(
    model: Path,
    extras: list[dict[str, Any] | None],
    requests: list[Any],
    *,
    kv_blocks: int,
    logs: Path,
    label: str,
) -> tuple[list[float], list[list[int]], dict[str, int]]:
    """Round-robin ``requests`` over one engine per entry of ``extras``: (TTFTs,
    tokens, hit tokens of all engines by tier)."""
    engines = [
        Engine(model, extra, {"kv_blocks": kv_blocks}, logs / f"{label}-{i}.log")
        for i, extra in enumerate(extras)
    ]
    try:
        for engine in engines:
            engine.read()  # built
        for i, engine in enumerate(engines):  # a first forward pass, not timed; less
            engine.ask(prompt=[3 + i] * (BLOCK - 1))  # than a chunk: nothing stored
        ttfts, outputs = [], []
        for k, (_, _, prompt) in enumerate(requests):
            answer = engines[k % len(engines)].ask(prompt=prompt)
            ttfts.append(answer["seconds"])
            outputs.append(answer["tokens"])
        readings = [e.ask(metrics=True) for e in engines]
        calls = [r["share_calls"] for r in readings if r["share_calls"]]
        if calls:
            print(f"  {label}: share link per engine {calls}")
        print(f"  {label}: TTFT ms by request {[round(t * 1000) for t in ttfts]}")
        hits = {t: sum(int(r["hit_tokens"].get(t, 0)) for r in readings) for t in ("host", "disk")}
        return ttfts, outputs, hits
    finally:
        for engine in engines:
            engine.close()


def stop_share(root: Path, name: str) -> None:
    """Stop the share's node process by its pid, waiting for it to exit."""
    from kvoffload.testing.share_process import stop_node_process

    stop_node_process(name, root)


def stop_disk_share(share_root: Path, disk_path: Path) -> None:
    """Stop the node process of the disk share of ``disk_path`` (one model), if any."""
    from kvoffload.testing.share_process import stop_node_process
    from kvoffload.tiers.disk import FORMAT_DIR
    from kvoffload.tiers.disk_backing import DiskBacking

    for namespace in (disk_path / FORMAT_DIR).glob("*"):
        paths = DiskBacking(disk_path, bytes.fromhex(namespace.name)).paths(share_root)
        stop_node_process(paths.name, paths.root)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--preset", default="demo", help="kvoffload.demos.tiny_model preset")
    parser.add_argument("--users", type=int, default=7)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=8 * BLOCK)
    parser.add_argument("--message-tokens", type=int, default=2 * BLOCK)
    parser.add_argument("--share-chunks", type=int, default=0, help="S in chunks (0: fit all)")
    parser.add_argument("--kv-blocks", type=int, default=32, help="engine KV blocks each")
    parser.add_argument(
        "--disk-chunks", type=int, default=0, help="D: a disk tier of D chunks (0: none)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved shared/private rounds (order alternating, a new share each); "
        "medians of the rounds reported",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if math.gcd(args.users, args.engines) != 1:
        parser.error("--users must be coprime to --engines (round robin moves users)")

    from kvoffload.demos.tiny_model import PRESETS, ensure_model

    preset = PRESETS[args.preset]
    scratch = Path(tempfile.mkdtemp(prefix="kvse-", dir="/tmp"))
    model = ensure_model(args.preset, scratch / "models")
    requests = chat_requests(
        args.users, args.turns, args.system_tokens, args.message_tokens, preset.vocab_size
    )
    head_dim = preset.hidden_size // preset.num_attention_heads
    chunk_bytes = 2 * preset.num_hidden_layers * preset.num_key_value_heads * head_dim * BLOCK * 4
    unique = args.system_tokens // BLOCK + args.users * args.turns * args.message_tokens // BLOCK
    chunks = args.share_chunks or unique + args.engines  # the whole working set, shared
    chunks -= chunks % args.engines
    share_bytes = chunks * chunk_bytes
    names = [f"bench-{os.getpid()}-{r}" for r in range(args.rounds)]

    from kvoffload.tiers.disk import slot_bytes

    disk_bytes = args.disk_chunks * slot_bytes(chunk_bytes)

    def shared(r: int) -> dict[str, Any]:
        extra = {
            "cpu_bytes": share_bytes,
            "host_share": names[r],
            "host_share_root": str(scratch),
            "host_share_timeout_ms": 1000,
        }
        if disk_bytes:
            extra.update(disk_path=str(scratch / f"disk-{r}"), disk_bytes=disk_bytes)
        return extra

    def private(r: int, i: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"cpu_bytes": share_bytes // args.engines}
        if disk_bytes:
            path = str(scratch / f"disk-{r}-{i}")
            extra.update(disk_path=path, disk_bytes=disk_bytes // args.engines)
        return extra

    print(
        f"{args.engines} engines ({args.preset}), {len(requests)} requests "
        f"({args.users} users x {args.turns} turns, system {args.system_tokens} tokens, "
        f"+{args.message_tokens} a turn), S = {chunks} chunks = {share_bytes / 2**20:.1f} MiB "
        f"(working set {unique} chunks), disk {args.disk_chunks} chunks, "
        f"engine KV {args.kv_blocks} blocks each; "
        f"{args.rounds} interleaved rounds; logs {scratch} (removed when the outputs are identical)"
    )
    began = time.monotonic()
    run: dict[str, Any] = {"kv_blocks": args.kv_blocks, "logs": scratch}
    means: dict[str, list[float]] = {"shared": [], "private": []}
    hits: dict[str, list[dict[str, int]]] = {"shared": [], "private": []}
    same = True
    try:
        ref, want, _ = serve(model, [None], requests, **run, label="reference")
        for r in range(args.rounds):
            order = ("shared", "private") if r % 2 == 0 else ("private", "shared")
            for label in order:
                each = range(args.engines)
                extras = [shared(r) if label == "shared" else private(r, i) for i in each]
                ttfts, got, hit = serve(model, extras, requests, **run, label=f"{label} {r + 1}")
                if label == "shared":
                    stop_share(scratch, names[r])  # a new, empty share each round
                    stop_disk_share(scratch, scratch / f"disk-{r}")
                means[label].append(sum(ttfts) / len(ttfts))
                hits[label].append(hit)
                same = same and got == want
    finally:
        for r, each in enumerate(names):
            stop_share(scratch, each)
            stop_disk_share(scratch, scratch / f"disk-{r}")
    print(f"  mean TTFT reference {sum(ref) / len(ref) * 1000:8.1f} ms (one engine, no offload)")
    for label, values in means.items():
        print(
            f"  mean TTFT {label:9s} by round {[round(v * 1000, 1) for v in values]} ms, "
            f"median {statistics.median(values) * 1000:.1f} ms; hit tokens {hits[label]}"
        )
    ratios = [a / b for a, b in zip(means["shared"], means["private"], strict=True)]
    ratio = statistics.median(ratios)
    print(
        f"shared/private mean TTFT = {ratio:.2f}x, median of {args.rounds} rounds "
        f"{[round(x, 2) for x in ratios]} (target <= 0.70: "
        f"{'met' if ratio <= 0.7 else 'NOT met'}); outputs identical to no offload: "
        f"{'yes' if same else 'NO'}; {time.monotonic() - began:.0f} s"
    )
    if same:
        shutil.rmtree(scratch, ignore_errors=True)  # the model and the logs
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
