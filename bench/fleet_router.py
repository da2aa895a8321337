"""KV-aware routing over engines on one node share: does crediting every engine with
what the share holds (issue 34) pay, and what does it cost in events?

N real vLLM engines (``engine_process.Engine``: separate processes, CPU, float32,
greedy, ``max_tokens`` 1) on one node-shared host tier (``host_share``; with
``--disk-chunks D`` also one shared disk tier of D chunks), each with vLLM's KV events
on (a ZMQ publisher on a free port), behind a minimal front (``kv_front.Front``) that
asks Dynamo's standalone indexer (``kvoffload.testing.dynamo_indexer``) which engine
holds the request's prefix: score = tokens in the engine's memory x 1.0 + tokens only
in its host memory x 0.75 (Dynamo's default weights), ties to the engine sent the
fewest requests, then round-robin. Configurations, the same requests each:

- ``round-robin``: the front ignores the indexer (engines as in indexer-shared);
- ``indexer-own``: engines with ``share_announce_ms: 0``: each announces only the
  chunks it stored itself (the indexer credits no engine with the share as a whole);
- ``indexer-shared``: engines with the default announcements: every engine announces
  every chunk the share holds.

Workload (``share_engines.chat_requests``): U users' multi-turn chat, every prompt the
shared system prompt + that user's messages so far, users' turns interleaved; sized so
that an engine's KV cache (``--kv-blocks``) cannot hold every user's history (prefixes
leave engine memory and stay in the share), the share holds all of it.

Each run starts new engines on a new share, then the indexer (all configurations: the
same processes and the same settling in each; only the front's choice differs), and
waits for its subscription to each engine (fresh one-chunk probes until the indexer
credits one, as ``tests/vllm/test_router_dynamo_fleet.py`` does). Every engine then
serves the system prompt, untimed (a fleet in steady state has served it; ``--cold``
skips this, and a KV-aware front then sends everything to the first engine: with
requests one at a time, the engine holding the system prompt always scores highest).
Each request is answered alone, its TTFT measured in the engine around ``generate``;
then the engine drains its stores and the front polls the indexer until it credits
the serving engine's memory with the prompt, and (announcing engines) every engine
with it in some tier, within ``--settle-s`` (past it the run goes on, counted), as a
steady stream of later requests would find it. ``reference``: one engine without
kvoffload serves the requests first; every run's outputs must equal its outputs.
Then ``--rounds`` rounds, the configurations' order alternating, medians reported.

Event volume: a ZMQ subscriber per engine (``event_tap.EventTap``, connected before
the engine binds) counts the host-tier (``CPU``) events and bytes each engine
published over its life, against the chunks all engines stored into the share
(kvoffload's ``transferred_chunks_total{direction="store",tier="host"}``).

    PYTHONPATH=src nice -n 19 python bench/fleet_router.py [--engines 2] [--preset smoke]
        [--rounds 3] [--disk-chunks D] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_process import BLOCK, Engine
from event_tap import EventTap
from kv_front import Front, settled
from share_engines import chat_requests, stop_disk_share, stop_share

CONFIGS = ("round-robin", "indexer-own", "indexer-shared")
PRESETS: dict[str, dict[str, int]] = {
    "default": {
        "users": 7,
        "turns": 4,
        "system_tokens": 8 * BLOCK,
        "message_tokens": 2 * BLOCK,
        "kv_blocks": 24,
        "rounds": 3,
    },
    "smoke": {
        "users": 3,
        "turns": 2,
        "system_tokens": 8 * BLOCK,
        "message_tokens": 2 * BLOCK,
        "kv_blocks": 16,
        "rounds": 1,
    },
}


@dataclass(frozen=True)
class Setup:
    """What every run shares."""

    model: Path
    scratch: Path
    requests: list[Any]
    system_prompt: list[int]
    engines: int
    options: dict[str, Any]  # engine options (engine_process)
    share_bytes: int
    disk_bytes: int
    settle_s: float
    warm: bool


def probe(n: int) -> list[int]:
    """Probe ``n``: one chunk and a token, sharing no block with the workload."""
    return [(11 * n + 5 * i) % 991 + 5 for i in range(BLOCK + 1)]


def subscribe(indexer: Any, engine: Engine, worker: int, salt: int) -> int:
    """Serve fresh probes on ``engine`` until the indexer credits one to ``worker``
    (ZMQ drops what is published before a subscriber joins); the probes it took."""
    from kvoffload.testing.dynamo_indexer import poll

    for n in range(20):
        tokens = probe(100 * salt + n)
        engine.ask(prompt=tokens)
        if poll(
            lambda t=tokens: indexer.query(t[:BLOCK]),
            lambda ans: ans[worker]["gpu"] == BLOCK,
            within=2.0,
        ):
            return n + 1
    raise RuntimeError(f"the indexer never credited worker {worker}'s probe")


def run_fleet(setup: Setup, config: str, r: int) -> dict[str, Any]:
    """One run of ``config`` (round ``r``) on new engines and a new share."""
    from kvoffload.testing.dynamo_indexer import Indexer
    from kvoffload.testing.ports import free_port

    label = f"{config} {r + 1}"
    name = f"fleet-{os.getpid()}-{r}-{config}"
    extra: dict[str, Any] = {
        "cpu_bytes": setup.share_bytes,
        "host_share": name,
        "host_share_root": str(setup.scratch),
        "host_share_timeout_ms": 1000,
    }
    if config == "indexer-own":
        extra["share_announce_ms"] = 0
    disk = setup.scratch / f"disk-{name}"
    if setup.disk_bytes:
        extra.update(disk_path=str(disk), disk_bytes=setup.disk_bytes)
    n = setup.engines
    ports = [free_port() for _ in range(n)]
    workers = [i + 1 for i in range(n)]
    taps = [EventTap(port) for port in ports]  # before the engines bind
    logs = setup.scratch / "logs"
    engines: list[Engine] = []
    indexer: Indexer | None = None
    try:
        for i, port in enumerate(ports):
            options = {**setup.options, "kv_events_port": port}
            log = logs / f"{config}-{r + 1}-{i}.log"
            engines.append(Engine(setup.model, extra, options, log))
        for engine in engines:
            engine.read()  # built
        indexer = Indexer(BLOCK, logs / f"{config}-{r + 1}-indexer.log")
        indexer.start(dict(zip(workers, ports, strict=True)))
        ask = indexer.query
        probes = [subscribe(indexer, e, workers[i], i) for i, e in enumerate(engines)]
        everyone = config != "indexer-own"  # engines announce what the share holds
        late = 0
        if setup.warm:
            for i, engine in enumerate(engines):
                engine.ask(prompt=setup.system_prompt)
                late += not settled(
                    ask,
                    setup.system_prompt,
                    workers[i],
                    workers,
                    block=BLOCK,
                    everyone=everyone,
                    within_s=setup.settle_s,
                )
        before = [e.ask(metrics=True) for e in engines]
        front = Front(workers, ask, kv_aware=config != "round-robin")
        ttfts, outputs, cached, chosen, query_s = [], [], 0, [], []
        credited = {"gpu": 0, "host": 0}  # the chosen engine's credit at routing
        for _, _, prompt in setup.requests:
            route = front.route(prompt)
            answer = engines[route.engine].ask(prompt=prompt)
            ttfts.append(answer["seconds"])
            outputs.append(answer["tokens"])
            cached += answer["cached"]
            chosen.append(route.engine)
            query_s.append(route.query_s)
            assert route.credit is not None
            mine = route.credit[workers[route.engine]]
            credited["gpu"] += mine["gpu"]
            credited["host"] += mine["cpu"] - mine["gpu"]
            late += not settled(
                ask,
                prompt,
                workers[route.engine],
                workers,
                block=BLOCK,
                everyone=everyone,
                within_s=setup.settle_s,
            )
        after = [e.ask(metrics=True) for e in engines]
        tallies = [tap.stop() for tap in taps]
        taps = []
    finally:
        for tap in taps:
            tap.stop()
        for engine in engines:
            engine.close()
        if indexer is not None:
            indexer.stop()
        stop_share(setup.scratch, name)  # a new, empty share each run
        if setup.disk_bytes:
            stop_disk_share(setup.scratch, disk)

    def delta(tier: str) -> int:
        return sum(
            int(a["hit_tokens"].get(tier, 0)) - int(b["hit_tokens"].get(tier, 0))
            for a, b in zip(after, before, strict=True)
        )

    host, on_disk = delta("host"), delta("disk")
    stored = [int(a["stored_chunks"]) for a in after]
    result = {
        "config": config,
        "round": r + 1,
        "ttft_s": ttfts,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "outputs": outputs,
        "hit_tokens": {
            "engine": cached - host - on_disk,
            "host": host,
            "disk": on_disk,
            "total": cached,
        },
        "credited_at_routing": credited,
        "routed": [chosen.count(i) for i in range(n)],
        "route_sequence": chosen,
        "query_ms_mean": 1000 * sum(query_s) / len(query_s),
        "probes": probes,
        "settle_timeouts": late,
        "stored_chunks": stored,
        "events": [events_of(t, sum(stored)) for t in tallies],
        "announcer": [a["announcer"] for a in after],
        "share_calls": [a["share_calls"] for a in after],
    }
    print(
        f"  {label}: TTFT ms {[round(t * 1000) for t in ttfts]}; routed {result['routed']} "
        f"{''.join(str(c + 1) for c in chosen)}; hits {result['hit_tokens']}; "
        f"settle timeouts {late}; host events per engine "
        f"{[e['CPU']['events'] for e in result['events']]} for {sum(stored)} chunks stored",
        flush=True,
    )
    return result


def events_of(tally: Any, stored: int) -> dict[str, Any]:
    """One engine's event counts by medium, and its host-tier events per chunk stored
    into the share by all engines (``stored``)."""
    out: dict[str, Any] = {m: tally.of(m) for m in ("GPU", "CPU", "STORAGE")}
    cpu = out["CPU"]
    out["per_chunk"] = cpu["events"] / stored if stored else 0.0
    out["first_per_chunk"] = (cpu["events"] - cpu["repeats"]) / stored if stored else 0.0
    out["bytes_per_chunk"] = cpu["bytes"] / stored if stored else 0.0
    out.update(batches=tally.batches, payload_bytes=tally.payload_bytes, complete=tally.complete)
    return out


def reference(setup: Setup) -> tuple[list[float], list[list[int]]]:
    """One engine without kvoffload, warmed as the fleet's: (TTFTs, outputs) of the
    requests."""
    engine = Engine(setup.model, None, setup.options, setup.scratch / "logs" / "reference.log")
    try:
        engine.read()
        engine.ask(prompt=probe(99))  # a first forward pass, not timed
        if setup.warm:
            engine.ask(prompt=setup.system_prompt)  # as the fleet's engines, untimed
        answers = [engine.ask(prompt=prompt) for _, _, prompt in setup.requests]
    finally:
        engine.close()
    return [a["seconds"] for a in answers], [a["tokens"] for a in answers]


# ---------------------------------------------------------------- the report


def med(values: list[float]) -> float:
    return statistics.median(values)


def summarize(runs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Per configuration: medians over rounds; the ratios of mean TTFT (median of the
    rounds' ratios); event volume per engine."""
    out: dict[str, Any] = {}
    for config in CONFIGS:
        mine = [run for run in runs if run["config"] == config]
        if not mine:
            continue
        out[config] = {
            "mean_ttft_s_by_round": [run["mean_ttft_s"] for run in mine],
            "mean_ttft_s": med([run["mean_ttft_s"] for run in mine]),
            "median_ttft_s": med([run["median_ttft_s"] for run in mine]),
            "hit_tokens": {
                k: med([run["hit_tokens"][k] for run in mine])
                for k in ("engine", "host", "disk", "total")
            },
            "credited_at_routing": {
                k: med([run["credited_at_routing"][k] for run in mine]) for k in ("gpu", "host")
            },
            "routed_by_round": [run["routed"] for run in mine],
            "identical": all(run["identical"] for run in mine),
            "settle_timeouts": sum(run["settle_timeouts"] for run in mine),
            "stored_chunks": med([sum(run["stored_chunks"]) for run in mine]),
            "host_events": [
                med([run["events"][i]["CPU"]["events"] for run in mine]) for i in range(n)
            ],
            "events_per_chunk": [
                med([run["events"][i]["per_chunk"] for run in mine]) for i in range(n)
            ],
            "first_events_per_chunk": [
                med([run["events"][i]["first_per_chunk"] for run in mine]) for i in range(n)
            ],
            "event_bytes_per_chunk": [
                med([run["events"][i]["bytes_per_chunk"] for run in mine]) for i in range(n)
            ],
            "taps_complete": all(e["complete"] for run in mine for e in run["events"]),
        }

    def ratio(a: str, b: str) -> dict[str, Any] | None:
        if a not in out or b not in out:
            return None
        by_round = [
            x / y
            for x, y in zip(
                out[a]["mean_ttft_s_by_round"], out[b]["mean_ttft_s_by_round"], strict=True
            )
        ]
        return {"median": med(by_round), "by_round": by_round}

    out["ratios"] = {
        "indexer-shared/round-robin": ratio("indexer-shared", "round-robin"),
        "indexer-shared/indexer-own": ratio("indexer-shared", "indexer-own"),
    }
    return out


def print_report(summary: dict[str, Any], ref_mean: float, n: int) -> None:
    """The tables (medians over rounds)."""
    print(f"\nmean TTFT, reference (one engine, no offload): {ref_mean * 1000:.1f} ms")
    print(
        f"{'configuration':15s} {'mean TTFT ms':>12s} {'median':>7s}  {'means by round':22s} "
        f"{'hit tokens: engine + host + disk = total':42s} same"
    )
    for config in CONFIGS:
        s = summary.get(config)
        if s is None:
            continue
        h = s["hit_tokens"]
        hits = f"{h['engine']:.0f} + {h['host']:.0f} + {h['disk']:.0f} = {h['total']:.0f}"
        rounds = str([round(v * 1000, 1) for v in s["mean_ttft_s_by_round"]])
        print(
            f"{config:15s} {s['mean_ttft_s'] * 1000:12.1f} {s['median_ttft_s'] * 1000:7.1f}  "
            f"{rounds:22s} {hits:42s} {'yes' if s['identical'] else 'NO'}"
        )
    print(
        f"\n{'configuration':15s} {'routed per engine, by round':30s} "
        f"{'chosen engine credited: gpu + host tokens':42s} settle timeouts"
    )
    for config in CONFIGS:
        s = summary.get(config)
        if s is None:
            continue
        routed = " ".join(str(x) for x in s["routed_by_round"])
        c = s["credited_at_routing"]
        credit = f"{c['gpu']:.0f} + {c['host']:.0f}"
        print(f"{config:15s} {routed:30s} {credit:42s} {s['settle_timeouts']}")
    print()
    for name, ratio in summary["ratios"].items():
        if ratio is not None:
            rounds = [round(x, 2) for x in ratio["by_round"]]
            print(f"{name} mean TTFT = {ratio['median']:.2f}x (median of rounds {rounds})")
    print(
        "\nhost-tier (CPU) KV events each engine published per chunk stored into the share "
        "(by all engines), median of rounds: all [first announcements only], bytes"
    )
    for config in CONFIGS:
        s = summary.get(config)
        if s is None:
            continue
        cells = [
            f"{s['events_per_chunk'][i]:.2f} [{s['first_events_per_chunk'][i]:.2f}], "
            f"{s['event_bytes_per_chunk'][i]:.0f} B ({s['host_events'][i]:.0f} events)"
            for i in range(n)
        ]
        fleet = sum(s["events_per_chunk"])
        print(
            f"{config:15s} "
            + " | ".join(f"engine {i + 1}: {c}" for i, c in enumerate(cells))
            + f" | fleet {fleet:.2f}; {s['stored_chunks']:.0f} chunks stored"
            + ("" if s["taps_complete"] else " (a tap missed events)")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2, help="N, 2 to 4")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="workload size (smoke: a couple of minutes)",
    )
    parser.add_argument("--model", default="demo", help="kvoffload.demos.tiny_model preset")
    parser.add_argument("--users", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--message-tokens", type=int)
    parser.add_argument("--kv-blocks", type=int, help="engine KV blocks each")
    parser.add_argument("--rounds", type=int, help="interleaved rounds, order alternating")
    parser.add_argument(
        "--share-chunks",
        type=int,
        default=0,
        help="host share in chunks (0: the working set and the probes)",
    )
    parser.add_argument(
        "--disk-chunks", type=int, default=0, help="D: one shared disk tier of D chunks (0: none)"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        help="how long to wait for the indexer's credit after a request",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="engines do not serve the system prompt before the requests",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 2 <= args.engines <= 4:
        parser.error("--engines must be 2, 3 or 4")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if math.gcd(args.users, args.engines) != 1:
        parser.error("--users must be coprime to --engines (round robin moves users)")

    from kvoffload.demos.tiny_model import PRESETS as MODELS
    from kvoffload.demos.tiny_model import ensure_model
    from kvoffload.testing.dynamo_indexer import dynamo_python
    from kvoffload.tiers.disk import slot_bytes

    dynamo_python()  # fails now, not after the reference, without .venv-dynamo
    shape = MODELS[args.model]
    scratch = Path(tempfile.mkdtemp(prefix="kvfr-", dir="/tmp"))
    (scratch / "logs").mkdir()
    model = ensure_model(args.model, scratch / "models")
    requests = chat_requests(
        args.users, args.turns, args.system_tokens, args.message_tokens, shape.vocab_size
    )
    head_dim = shape.hidden_size // shape.num_attention_heads
    chunk_bytes = 2 * shape.num_hidden_layers * shape.num_key_value_heads * head_dim * BLOCK * 4
    unique = args.system_tokens // BLOCK + args.users * args.turns * args.message_tokens // BLOCK
    chunks = args.share_chunks or unique + 4 * args.engines  # and the probes
    longest = max(len(p) for _, _, p in requests)
    need = -(-(longest + 1) // BLOCK)
    if args.kv_blocks < need:
        parser.error(f"--kv-blocks must hold the longest request ({need} blocks)")
    setup = Setup(
        model=model,
        scratch=scratch,
        requests=requests,
        system_prompt=requests[0][2][: args.system_tokens],
        engines=args.engines,
        options={"kv_blocks": args.kv_blocks, "max_model_len": longest + BLOCK},
        share_bytes=chunks * chunk_bytes,
        disk_bytes=args.disk_chunks * slot_bytes(chunk_bytes),
        settle_s=args.settle_s,
        warm=not args.cold,
    )
    print(
        f"{args.engines} engines ({args.model}), {len(requests)} requests "
        f"({args.users} users x {args.turns} turns, system {args.system_tokens} tokens, "
        f"+{args.message_tokens} a turn), working set {unique} chunks; engine KV "
        f"{args.kv_blocks} blocks each; host share {chunks} chunks "
        f"({setup.share_bytes / 2**20:.1f} MiB), disk {args.disk_chunks} chunks; "
        f"{'cold' if args.cold else 'engines warmed with the system prompt'}; "
        f"{args.rounds} interleaved rounds; logs {scratch} (removed when the outputs "
        f"are identical)",
        flush=True,
    )
    began = time.monotonic()
    ref_ttfts, want = reference(setup)
    print(f"  reference: TTFT ms {[round(t * 1000) for t in ref_ttfts]}", flush=True)
    runs = []
    for r in range(args.rounds):
        order = CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))
        for config in order:
            run = run_fleet(setup, config, r)
            run["identical"] = run.pop("outputs") == want
            runs.append(run)
    summary = summarize(runs, args.engines)
    ref_mean = sum(ref_ttfts) / len(ref_ttfts)
    print_report(summary, ref_mean, args.engines)
    same = all(run["identical"] for run in runs)
    elapsed = time.monotonic() - began
    print(f"outputs identical to no offload: {'yes' if same else 'NO'}; {elapsed:.0f} s")
    if args.json is not None:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        report = {
            "settings": settings,
            "reference_ttft_s": ref_ttfts,
            "runs": runs,
            "summary": summary,
            "seconds": elapsed,
        }
        args.json.write_text(json.dumps(report, indent=1))
    if same:
        shutil.rmtree(scratch, ignore_errors=True)  # the model and the logs
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
