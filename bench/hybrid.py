"""A hybrid model on a real vLLM engine: kvoffload with the hybrid KV cache manager on.

Workload: the demo's multi-turn chat (``kvoffload.workload.chat``, as
``bench/e2e.py`` builds it: several users, a shared system prompt, growing
histories, each turn of all users one batch) on ``demo-gemma3``, the demo's size
as a Gemma-3-style hybrid (12 layers: 10 sliding-window layers of 512 tokens, 2
full attention). With vLLM's hybrid KV cache manager (HMA) the engine keeps six
KV cache groups of two layers (five window groups, one full) in one block pool;
without it, one group of all twelve layers.

Configurations, each (configuration, run) on a fresh in-process engine, runs
interleaved across configurations, medians reported:
(1) ``none``: no connector (HMA on, vLLM's default);
(2) ``kvoffload``: kvoffload's connector with HMA on (checked: the engine did not
    disable it and built several KV cache groups);
(3) ``kvoffload-hma-off``: kvoffload with ``disable_hybrid_kv_cache_manager=True``
    (checked: one KV cache group);
(4) ``vllm-offload``: vLLM's native OffloadingConnector with the CPU copy spec of
    ``vllm_cpu_offload_spec.py``, HMA as vLLM leaves it; if it fails, its error is
    reported (one line) as unavailable.
Every engine gets the same ``kv_cache_memory_bytes``, sized so that with HMA off
it holds about a quarter of the chat's working set (as in ``bench/e2e.py``); both
connectors get the same host capacity (the whole working set fits).

Reported: mean and p90 TTFT (vLLM's per-request ``first_token_latency``),
throughput, prompt tokens served by the connector, the engine's KV cache
structure and the tokens its pool holds with HMA on and off, kvoffload's host
bytes per distinct stored token with HMA on and off, and, for the kvoffload HMA-on
run, the window-group and full-attention chunks stored vs ever loaded by a later
hit (counted by wrapping ``store_entries`` / ``load_entries`` of kvoffload's
scheduler in this process). Targets: kvoffload mean TTFT <= the HMA-off figure and
<= 0.3x no offload; greedy float32 outputs of every configuration equal
``none``'s. An output mismatch, or a kvoffload configuration that fails, makes the
exit status non-zero. Usage: ``python bench/hybrid.py [--quick] [--runs N]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvoffload.demos.chat_demo import ChatSetup, kvoffload_config, kvoffload_unavailable
from kvoffload.demos.chat_demo import make_setup as make_chat_setup
from kvoffload.demos.tiny_model import ensure_model, kv_bytes_per_token
from kvoffload.demos.vllm_runner import (
    EngineSpec,
    RunResult,
    open_engine,
    run_batches,
    turn_batches,
    warm_up,
)
from kvoffload.workload.chat import ChatRequest

CONFIGS = ("none", "kvoffload", "kvoffload-hma-off", "vllm-offload")
KVOFFLOAD_CONFIGS = ("kvoffload", "kvoffload-hma-off")


# --- what the engine built -------------------------------------------------------


@dataclass(frozen=True)
class Group:
    kind: str  # "full" or "window"
    window: int | None  # tokens (window groups)
    layers: int


@dataclass(frozen=True)
class EngineInfo:
    """The KV cache vLLM built: HMA on or off, its groups, its block pool."""

    hma: bool
    groups: tuple[Group, ...]
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    admitted_tokens: int  # vLLM's kv_cache_size_tokens: concurrency at max_model_len x it

    def describe(self) -> str:
        kinds: dict[tuple[str, int | None, int], int] = {}
        for g in self.groups:
            kinds[(g.kind, g.window, g.layers)] = kinds.get((g.kind, g.window, g.layers), 0) + 1
        parts = [
            f"{n} {kind}{f' {w}' if w else ''} ({layers} layer{'s' * (layers > 1)})"
            for (kind, w, layers), n in kinds.items()
        ]
        return f"{len(self.groups)} group(s): " + " + ".join(parts)

    def resident_blocks(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens holds once its prefill is done: a full
        group one per ``block_size`` tokens, a window group only its window's (what
        vLLM's sliding-window manager keeps: the last ``window`` tokens, one block more
        when they straddle a block boundary)."""
        bs = self.block_size
        held = 0
        for g in self.groups:
            blocks = -(-tokens // bs)
            if g.window is not None and self.hma:
                blocks = min(blocks, -(-g.window // bs) + 1)
            held += blocks
        return held

    def resident_tokens(self, request_tokens: int) -> int:
        """Tokens of requests of ``request_tokens`` tokens the pool holds after their
        prefill: pool blocks (the null block excluded) / blocks one such request holds
        x its tokens (a fraction of a request counts)."""
        return (self.num_blocks - 1) * request_tokens // self.resident_blocks(request_tokens)


def engine_info(llm: Any) -> EngineInfo:
    core = llm.llm_engine.engine_core.engine_core
    vllm_config = core.vllm_config
    kv = core.scheduler.kv_cache_config
    groups = []
    for g in kv.kv_cache_groups:
        spec = g.kv_cache_spec
        full = type(spec).__name__ != "SlidingWindowSpec"
        window = None if full else spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
        groups.append(Group("full" if full else "window", window, len(g.layer_names)))
    return EngineInfo(
        hma=vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False,
        groups=tuple(groups),
        num_blocks=kv.num_blocks,
        block_size=kv.kv_cache_groups[0].kv_cache_spec.block_size,
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        admitted_tokens=int(vllm_config.cache_config.kv_cache_size_tokens or 0),
    )


# --- kvoffload's chunks, counted in process ----------------------------------------


@dataclass
class ChunkRecorder:
    """Entries kvoffload's scheduler offered to store and loaded, by entry key.

    ``chain``: every stored entry's (chain key, group) since the engine started
    (warm-up included; for host bytes per token); ``stored`` / ``loaded``: entry
    keys offered to a store / loaded into at least one engine block since
    :meth:`workload_starts` (the chat alone)."""

    chain: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)
    stored: set[bytes] = field(default_factory=set)
    loaded: set[bytes] = field(default_factory=set)
    loaded_entries: dict[int, int] = field(default_factory=dict)  # group -> entries loaded

    def on_store(self, source: Any, keys: Sequence[bytes]) -> None:
        """``source``: a ``StoreSource`` (parallel lists: chunks, groups, keys)."""
        for chunk, group, key in zip(source.chunks, source.groups, source.keys, strict=True):
            self.chain[key] = (keys[chunk], group)
            self.stored.add(key)

    def on_load(self, entries: Sequence[Any]) -> None:
        from kvoffload.core.jobs import NO_BLOCK

        for e in entries:
            if any(b != NO_BLOCK for b in e.blocks):
                self.loaded.add(e.key)
                self.loaded_entries[e.group] = self.loaded_entries.get(e.group, 0) + 1

    def engine_starts(self) -> None:
        self.chain.clear()
        self.workload_starts()

    def workload_starts(self) -> None:
        self.stored.clear()
        self.loaded.clear()
        self.loaded_entries.clear()


RECORDER = ChunkRecorder()


def install_recorder() -> None:
    """Wrap the scheduler's ``store_entries`` / ``load_entries`` (where the store and
    load planners look them up) so every call reports to ``RECORDER``. Idempotent."""
    from kvoffload.core.scheduler import loads, stores

    if getattr(stores.store_entries, "_recorded", False):
        return
    store_entries, load_entries = stores.store_entries, loads.load_entries

    def recorded_store(*args: Any, **kwargs: Any) -> Any:
        entries = store_entries(*args, **kwargs)
        RECORDER.on_store(entries, args[1])
        return entries

    def recorded_load(*args: Any, **kwargs: Any) -> Any:
        entries = load_entries(*args, **kwargs)
        RECORDER.on_load(entries)
        return entries

    recorded_store._recorded = True  # type: ignore[attr-defined]
    stores.store_entries = recorded_store  # type: ignore[assignment]
    loads.load_entries = recorded_load  # type: ignore[assignment]


@dataclass(frozen=True)
class GroupChunks:
    stored: int  # distinct entries stored (still on the host at the end)
    used: int  # of those, loaded by a later hit at least once
    loads: int  # entries loaded, repeats included


@dataclass(frozen=True)
class HostUse:
    """kvoffload's host tier at the end of a run, and its chunks by group kind."""

    bytes_used: int
    distinct_tokens: int
    window: GroupChunks
    full: GroupChunks
    anomalies: dict[str, int]

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_used / self.distinct_tokens if self.distinct_tokens else 0.0


def host_use(llm: Any) -> HostUse:
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    sched = side.scheduler
    directory, groups = sched.directory, side.geometry.kv_groups
    chunk_tokens = side.geometry.blocks_per_chunk * side.geometry.block_size
    present = set(directory.present_keys())
    chains = {RECORDER.chain[k][0] for k in present if k in RECORDER.chain}
    unknown = len([k for k in present if k not in RECORDER.chain])

    def count(full: bool) -> GroupChunks:
        def mine(g: int) -> bool:
            return groups.groups[g].full is full

        stored = {k for k in RECORDER.stored & present if mine(RECORDER.chain[k][1])}
        loads = sum(n for g, n in RECORDER.loaded_entries.items() if mine(g))
        return GroupChunks(len(stored), len(stored & RECORDER.loaded), loads)

    anomalies = {str(k): v for k, v in sched.anomalies.counts.items()}
    if unknown:
        anomalies["host keys not seen by the recorder"] = unknown
    return HostUse(
        bytes_used=directory.used_slots * side.chunk_bytes,
        distinct_tokens=len(chains) * chunk_tokens,
        window=count(False),
        full=count(True),
        anomalies=anomalies,
    )


# --- the runs --------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    result: RunResult
    engine: EngineInfo
    host: HostUse | None  # kvoffload runs only


@dataclass(frozen=True)
class Setup:
    chat: ChatSetup
    runs: int

    def engine(self, config: str) -> EngineSpec:
        """The same engine for every configuration; the connector and HMA differ."""
        from vllm_cpu_offload_spec import spec_config  # imports torch: after logging set-up

        host = self.chat.host_bytes()
        transfer = {
            "none": None,
            "kvoffload": kvoffload_config(host),
            "kvoffload-hma-off": kvoffload_config(host),
            "vllm-offload": spec_config(host),
        }[config]
        spec = self.chat.engine(transfer)
        if config == "kvoffload-hma-off":
            spec = replace(spec, disable_hybrid_kv_cache_manager=True)
        return spec


def make_setup(quick: bool, runs: int | None, users: int | None, turns: int | None) -> Setup:
    """The demo's chat on the demo-sized hybrid (``--quick``: the small chat on
    ``tiny-gemma3``, six layers, 64-token windows)."""
    chat = make_chat_setup(quick, users, turns)
    chat = replace(chat, preset="tiny-gemma3" if quick else "demo-gemma3")
    return Setup(chat, runs or (1 if quick else 3))


def check_engine(config: str, info: EngineInfo) -> None:
    if config == "kvoffload":
        assert info.hma, "kvoffload: vLLM disabled the hybrid KV cache manager"
        assert len(info.groups) > 1, f"kvoffload: one KV cache group ({info.describe()})"
    if config == "kvoffload-hma-off":
        assert not info.hma, "kvoffload-hma-off: HMA still on"
        assert len(info.groups) == 1, f"kvoffload-hma-off: {info.describe()}"


def run_one(setup: Setup, config: str, batches: Sequence[Sequence[ChatRequest]]) -> Measured:
    """One fresh engine for ``config``: warm-up, the chat, what it built and stored."""
    RECORDER.engine_starts()
    with open_engine(setup.engine(config)) as llm:
        info = engine_info(llm)
        check_engine(config, info)
        warm_up(llm)
        RECORDER.workload_starts()
        result = run_batches(llm, batches)
        host = host_use(llm) if config in KVOFFLOAD_CONFIGS else None
    return Measured(result, info, host)


def measure(
    setup: Setup, batches: Sequence[Sequence[ChatRequest]], available: dict[str, str | None]
) -> dict[str, list[Measured]]:
    """``setup.runs`` runs per available configuration, interleaved; a configuration
    that raises is marked unavailable (the reason in ``available``) and skipped."""
    results: dict[str, list[Measured]] = {c: [] for c in CONFIGS}
    for i in range(setup.runs):
        for config in CONFIGS:
            if available[config] is not None:
                continue
            start = time.perf_counter()
            try:
                results[config].append(run_one(setup, config, batches))
                took = time.perf_counter() - start
                print(f"  run {i + 1}/{setup.runs} {config}: {took:.0f} s", flush=True)
            except Exception as exc:
                traceback.print_exc()
                reason = " ".join(f"{type(exc).__name__}: {exc}".split())
                available[config] = f"failed: {reason[:300]}"
                print(f"  run {i + 1}/{setup.runs} {config}: {available[config]}", flush=True)
    return results


# --- the report ------------------------------------------------------------------


def med(runs: list[Measured], metric: Callable[[RunResult], float]) -> float:
    return statistics.median(metric(m.result) for m in runs)


def mismatches(base: RunResult, runs: list[Measured]) -> tuple[int, int]:
    """(requests whose tokens differ from ``base`` in some run, requests per run)."""
    differ = set()
    for m in runs:
        for i, (x, y) in enumerate(zip(base.requests, m.result.requests, strict=True)):
            if x.token_ids != y.token_ids:
                differ.add(i)
    return len(differ), len(base.requests)


def chat_table(results: dict[str, list[Measured]], available: dict[str, str | None]) -> str:
    head = (
        f"{'config':<19}{'HMA':>4}{'mean TTFT':>10}{'p90':>9}{'gen tok/s':>11}"
        f"{'prompt tok/s':>14}{'engine hits':>13}{'connector hits':>16}{'same tokens':>13}"
    )
    lines = [head]
    base = results["none"][0].result if results["none"] else None
    for config in CONFIGS:
        runs = results[config]
        if not runs:
            lines.append(f"{config:<19}  not available: {available[config]}")
            continue
        same = "-"
        if base is not None:
            differ, total = mismatches(base, runs)
            same = f"{total - differ}/{total}"
        lines.append(
            f"{config:<19}{'on' if runs[0].engine.hma else 'off':>4}"
            f"{med(runs, lambda r: r.mean_ttft_s):>9.3f}s"
            f"{med(runs, lambda r: r.ttft_percentile(0.9)):>8.3f}s"
            f"{med(runs, lambda r: r.generated_tok_s):>11.1f}"
            f"{med(runs, lambda r: r.prompt_tok_s):>14.1f}"
            f"{med(runs, lambda r: float(r.local_hit_tokens)):>13.0f}"
            f"{med(runs, lambda r: float(r.external_hit_tokens)):>16.0f}"
            f"{same:>13}"
        )
    return "\n".join(lines)


def engine_lines(setup: Setup, results: dict[str, list[Measured]]) -> list[str]:
    w = setup.chat.workload
    last = [len(r.prompt) + r.output_tokens for r in w.requests()[-w.users :]]
    length = round(statistics.mean(last))
    lines = [
        f"engine KV cache, {setup.chat.engine(None).kv_cache_memory_bytes:,} bytes in every "
        f"configuration; 'admitted': vLLM's kv_cache_size_tokens (requests of max_model_len "
        f"the pool admits x max_model_len); 'resident': tokens of requests as long as the "
        f"chat's last turn ({length} tokens) the pool holds after their prefill, window groups "
        "keeping only their window's blocks (pool blocks / blocks per such request x its tokens)",
        f"  {'config':<19}{'HMA':>4}  {'groups':<52}{'blocks':>7}{'admitted':>10}{'resident':>10}",
    ]
    for config in CONFIGS:
        if not results[config]:
            continue
        e = results[config][0].engine
        lines.append(
            f"  {config:<19}{'on' if e.hma else 'off':>4}  {e.describe():<52}{e.num_blocks:>7}"
            f"{e.admitted_tokens:>10}{e.resident_tokens(length):>10}"
        )
    on = results["kvoffload"][0].engine if results["kvoffload"] else None
    off = results["kvoffload-hma-off"][0].engine if results["kvoffload-hma-off"] else None
    if on and off:
        lines.append(
            f"  HMA on / off: admitted {on.admitted_tokens / off.admitted_tokens:.2f}x, "
            f"resident {on.resident_tokens(length) / off.resident_tokens(length):.2f}x "
            f"(vLLM admits a request with every window group sized for min(window - 1 + "
            f"max_num_batched_tokens, max_model_len) = min(window - 1 + "
            f"{on.max_num_batched_tokens}, {on.max_model_len}) tokens)"
        )
    return lines


def host_lines(results: dict[str, list[Measured]]) -> list[str]:
    lines = ["kvoffload host tier at the end of a run (first run of each):"]
    per_token: dict[str, float] = {}
    for config in KVOFFLOAD_CONFIGS:
        if not results[config] or results[config][0].host is None:
            lines.append(f"  {config:<19}not available")
            continue
        h = results[config][0].host
        assert h is not None
        per_token[config] = h.bytes_per_token
        anomalies = f", anomalies {h.anomalies}" if h.anomalies else ""
        lines.append(
            f"  {config:<19}{h.bytes_used / 2**20:>8.1f} MiB for {h.distinct_tokens:>6} distinct "
            f"tokens: {h.bytes_per_token:>7.0f} bytes per stored token{anomalies}"
        )
    if len(per_token) == 2:
        ratio = per_token["kvoffload"] / per_token["kvoffload-hma-off"]
        lines.append(f"  bytes per stored token, HMA on / off: {ratio:.2f}x")
    runs = results["kvoffload"]
    if runs and runs[0].host is not None:
        h = runs[0].host
        lines.append(
            "kvoffload HMA on, the chat alone: chunks stored (distinct, on the host at the end) "
            "vs loaded by a later hit"
        )
        for label, c in (("window groups", h.window), ("full-attention group(s)", h.full)):
            share = f"{c.used / c.stored:.0%}" if c.stored else "n/a"
            lines.append(
                f"  {label:<24} stored {c.stored:>6}, ever loaded {c.used:>6} ({share} of stored "
                f"bytes used by a later hit), loads {c.loads:>6} (repeats included)"
            )
    return lines


def ratio_lines(results: dict[str, list[Measured]]) -> list[str]:
    def ttft(c: str) -> float | None:
        return med(results[c], lambda r: r.mean_ttft_s) if results[c] else None

    def line(label: str, num: float | None, den: float | None, target: str) -> str:
        value = f"{num / den:.2f}x" if num is not None and den else "n/a"
        return f"  {label:<44}{value:>7}   ({target})"

    k = ttft("kvoffload")
    return [
        "ratios (medians):",
        line("kvoffload mean TTFT / none", k, ttft("none"), "target <= 0.30"),
        line(
            "kvoffload mean TTFT / kvoffload-hma-off",
            k,
            ttft("kvoffload-hma-off"),
            "target <= 1.00",
        ),
        line("kvoffload mean TTFT / vllm-offload", k, ttft("vllm-offload"), "reference"),
        line("kvoffload-hma-off mean TTFT / none", ttft("kvoffload-hma-off"), ttft("none"), "ref."),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny-gemma3, small chat (minutes)")
    parser.add_argument("--runs", type=int, default=None, help="runs per configuration")
    parser.add_argument("--users", type=int, default=None, help="chat users (default 8)")
    parser.add_argument("--turns", type=int, default=None, help="chat turns (default 14; 3 quick)")
    args = parser.parse_args(argv)
    setup = make_setup(args.quick, args.runs, args.users, args.turns)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is first imported
    ensure_model(setup.chat.preset)
    install_recorder()

    available: dict[str, str | None] = {c: None for c in CONFIGS}
    reason = kvoffload_unavailable()
    if reason is not None:
        for config in KVOFFLOAD_CONFIGS:
            available[config] = f"kvoffload connector not available ({reason})"
    started = time.perf_counter()
    results = measure(setup, turn_batches(setup.chat.workload.requests()), available)

    c = setup.chat.workload
    kv_tokens = setup.chat.kv_cache_tokens()
    print(
        f"\nmodel {setup.chat.preset!r}, float32, block 32, 1 torch thread; engine KV "
        f"{kv_tokens} tokens with HMA off ({kv_tokens / c.working_set_tokens():.0%} of the chat "
        f"working set {c.working_set_tokens()}; {kv_bytes_per_token(setup.chat.preset):,} bytes "
        f"per token, all layers); host tier {setup.chat.host_bytes() >> 20} MiB; "
        f"{setup.runs} run(s), medians"
    )
    print(
        f"chat: {c.users} users x {c.turns} turns, system prompt {c.system_tokens}, "
        f"messages {c.user_tokens[0]}-{c.user_tokens[1]}, answers {c.output_tokens} tokens"
    )
    print(chat_table(results, available))
    print()
    print("\n".join(engine_lines(setup, results)))
    print()
    print("\n".join(host_lines(results)))
    print()
    print("\n".join(ratio_lines(results)))

    status = 0
    base = results["none"][0].result if results["none"] else None
    if base is None:
        print("\nOUTPUTS NOT CHECKED: the no-connector configuration did not run")
        status = 1
    else:
        bad = {cfg: mismatches(base, results[cfg]) for cfg in CONFIGS if results[cfg]}
        bad = {cfg: d for cfg, d in bad.items() if d[0]}
        if bad:
            for cfg, (differ, total) in bad.items():
                print(f"\n!!! OUTPUT MISMATCH: {cfg}: {differ}/{total} requests differ from none")
            status = 1
        else:
            ran = ", ".join(cfg for cfg in CONFIGS if results[cfg])
            print(f"\ngreedy float32 outputs identical to none's in every run: {ran}")
    for config in KVOFFLOAD_CONFIGS:
        if not results[config]:
            print(f"!!! {config} did not run: {available[config]}")
            status = 1
    print(f"\nbenchmark took {time.perf_counter() - started:.0f} s")
    return status


if __name__ == "__main__":
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    sys.exit(main())
