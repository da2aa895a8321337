"""Data-parallel replicas on one node: one node-shared host tier vs private ones.

N real vLLM engines (separate processes, in-process ``LLM`` each, CPU, float32, greedy)
serve a chat workload round-robin: U users (U coprime to N, so a user's next turn
lands on another replica), each turn's prompt = a shared system prompt + the user's
messages so far. Runs with the same requests:

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
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARK = "KVSHARE "
BLOCK = 32
HERE = Path(__file__).resolve()


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


# ---------------------------------------------------------------- engine processes


class Engine:
    """One engine process (this file run as ``child``)."""

    def __init__(self, model: Path, extra: dict[str, Any] | None, kv_blocks: int, log: Path):
        import kvoffload

        source = str(Path(kvoffload.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
        self.log = log.open("w")
        args = [sys.executable, str(HERE), "child", str(model), json.dumps(extra), str(kv_blocks)]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )

    def read(self) -> dict[str, Any]:
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
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError):
                self.ask(exit=True)
            if self.proc.poll() is None:
                self.proc.kill()
        self.proc.wait()
        self.log.close()


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
        Engine(model, extra, kv_blocks, logs / f"{label}-{i}.log") for i, extra in enumerate(extras)
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


# ---------------------------------------------------------------- the child process


def child_main(model: str, extra_json: str, kv_blocks: int) -> int:
    """One engine: answer {prompt} with its token and TTFT, {metrics}, {exit}."""
    extra = json.loads(extra_json)
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
    llm = LLM(
        **{**cpu_llm_args(model, BLOCK, kv_blocks * block_bytes, "float32"), "max_model_len": 512},
        max_num_seqs=1,
        kv_transfer_config=kvoffload_transfer(extra),
        disable_log_stats=True,
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
            hits, calls = {}, {}
            if connector is not None:
                reading = connector.scheduler_side.read_metrics(with_gauges=False)
                hits = {t: int(reading.value("hit_tokens_total", tier=t)) for t in ("host", "disk")}
                calls = {
                    series[1][0][1]: int(n)
                    for series, n in reading.counters.items()
                    if series[0] == "host_share_calls_total" and n
                }
            answer(hit_tokens=hits, share_calls=calls)
            continue
        began = time.perf_counter()
        (output,) = llm.generate(
            [TokensPrompt(prompt_token_ids=command["prompt"])], params, use_tqdm=False
        )
        seconds = time.perf_counter() - began
        if connector is not None:
            drain(llm)
        answer(tokens=list(output.outputs[0].token_ids), seconds=seconds)
    llm.llm_engine.engine_core.shutdown()
    return 0


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


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        sys.exit(child_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit(main())
