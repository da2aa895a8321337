"""End to end on a real vLLM engine: no offload vs vLLM's OffloadingConnector vs kvoffload.

Workloads (the same for every configuration):
- multi-turn chat (``kvoffload.workload.chat``): several users, a shared system
  prompt, growing histories; each turn of all users is one batch. The engine KV
  cache holds about a quarter of the working set, so histories are evicted
  between turns and only an offload tier can serve them.
- zero reuse: every prompt unique, five batches of eight on one engine (a single
  seven-second batch varies by +-20% run to run, far more than the 1% measured);
  measures what offloading costs when nothing is ever loaded back (stores only).

Configurations: (a) no connector; (b) vLLM's native OffloadingConnector with the
CPU copy spec in ``vllm_cpu_offload_spec.py`` (the baseline); (c) kvoffload's
connector (``kvoffload.vllm``), reported as unavailable if it cannot be imported
or fails. Both connectors get the same host capacity (the whole working set fits).

Every (workload, configuration, run) gets a fresh in-process engine; runs are
interleaved across configurations and medians are reported. TTFT is vLLM's
per-request ``first_token_latency`` (see ``kvoffload.demos.vllm_runner``).
Targets: kvoffload mean TTFT <= 0.3x no offload and <= 1.0x vLLM's connector;
zero-reuse throughput >= 0.99x no offload. Greedy float32 outputs must equal the
no-offload outputs. Usage: ``python bench/e2e.py [--quick] [--runs N]``.
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
from dataclasses import dataclass, replace

from kvoffload.demos.chat_demo import ChatSetup, kvoffload_config, kvoffload_unavailable
from kvoffload.demos.chat_demo import make_setup as make_chat_setup
from kvoffload.demos.tiny_model import PRESETS, ensure_model
from kvoffload.demos.vllm_runner import (
    EngineSpec,
    RunResult,
    run,
    turn_batches,
)
from kvoffload.workload.chat import ChatRequest, ChatWorkload

CONFIGS = ("no-offload", "vllm-offload", "kvoffload")


ZERO_BATCHES = 5


@dataclass(frozen=True)
class Setup:
    chat: ChatSetup  # the model, the chat workload and the cache sizes
    zero: ChatWorkload
    runs: int
    async_scheduling: bool

    def zero_batches(self) -> list[list[ChatRequest]]:
        """Batches of prompts unique across batches (one seed each)."""
        z = self.zero
        return [
            ChatWorkload(
                z.users, 1, 0, z.user_tokens, z.output_tokens, vocab=z.vocab, seed=z.seed + i
            ).requests()
            for i in range(ZERO_BATCHES)
        ]

    def engine(self, config: str) -> EngineSpec:
        """The same engine for every configuration; only the connector differs."""
        from vllm_cpu_offload_spec import spec_config  # imports torch: after logging set-up

        host = self.chat.host_bytes()
        transfer = {
            "no-offload": None,
            "vllm-offload": spec_config(host),
            "kvoffload": kvoffload_config(host),
        }[config]
        spec = self.chat.engine(transfer, self.async_scheduling)
        return replace(spec, max_num_seqs=max(self.chat.workload.users, self.zero.users))


def make_setup(
    quick: bool,
    runs: int | None,
    async_scheduling: bool,
    users: int | None = None,
    turns: int | None = None,
) -> Setup:
    """The demo's chat (``kvoffload demo``) and a zero-reuse batch on the same engine."""
    chat = make_chat_setup(quick, users, turns)
    vocab = PRESETS[chat.preset].vocab_size
    if quick:
        zero = ChatWorkload(8, 1, 0, (64, 160), 16, vocab=vocab, seed=2)
        return Setup(chat, zero, runs or 1, async_scheduling)
    zero = ChatWorkload(8, 1, 0, (128, 320), 32, vocab=vocab, seed=2)
    return Setup(chat, zero, runs or 3, async_scheduling)


def measure(
    setup: Setup,
    label: str,
    workload: Sequence[Sequence[ChatRequest]],
    available: dict[str, str | None],
) -> dict[str, list[RunResult]]:
    """Run ``workload`` ``setup.runs`` times per available configuration, interleaved.

    A configuration that raises is marked unavailable (its reason recorded in
    ``available``) and skipped from then on.
    """
    results: dict[str, list[RunResult]] = {c: [] for c in CONFIGS}
    for i in range(setup.runs):
        for config in CONFIGS:
            if available[config] is not None:
                continue
            start = time.perf_counter()
            try:
                results[config].append(run(setup.engine(config), workload))
                took = time.perf_counter() - start
                print(f"  {label} run {i + 1}/{setup.runs} {config}: {took:.0f} s", flush=True)
            except Exception as exc:
                traceback.print_exc()
                available[config] = f"failed: {type(exc).__name__}: {exc}"
    return results


def med(runs: list[RunResult], metric: Callable[[RunResult], float]) -> float:
    return statistics.median(metric(r) for r in runs)


def same_outputs(a: RunResult, b: RunResult) -> str:
    same = sum(x.token_ids == y.token_ids for x, y in zip(a.requests, b.requests, strict=True))
    return f"{same}/{len(a.requests)}"


def chat_table(results: dict[str, list[RunResult]], available: dict[str, str | None]) -> str:
    head = (
        f"{'config':<13}{'mean TTFT':>10}{'p50':>9}{'p90':>9}{'gen tok/s':>11}"
        f"{'prompt tok/s':>14}{'engine hits':>13}{'connector hits':>16}{'same tokens':>13}"
    )
    lines = [head]
    base = results["no-offload"][0] if results["no-offload"] else None
    for config in CONFIGS:
        runs = results[config]
        if not runs:
            lines.append(f"{config:<13}  not available: {available[config]}")
            continue
        lines.append(
            f"{config:<13}{med(runs, lambda r: r.mean_ttft_s):>9.3f}s"
            f"{med(runs, lambda r: r.ttft_percentile(0.5)):>8.3f}s"
            f"{med(runs, lambda r: r.ttft_percentile(0.9)):>8.3f}s"
            f"{med(runs, lambda r: r.generated_tok_s):>11.1f}"
            f"{med(runs, lambda r: r.prompt_tok_s):>14.1f}"
            f"{med(runs, lambda r: float(r.local_hit_tokens)):>13.0f}"
            f"{med(runs, lambda r: float(r.external_hit_tokens)):>16.0f}"
            f"{same_outputs(base, runs[0]) if base else '-':>13}"
        )
    return "\n".join(lines)


def zero_table(results: dict[str, list[RunResult]], available: dict[str, str | None]) -> str:
    lines = [f"{'config':<13}{'wall':>9}{'gen tok/s':>11}{'prompt tok/s':>14}{'hits':>8}"]
    for config in CONFIGS:
        runs = results[config]
        if not runs:
            lines.append(f"{config:<13}  not available: {available[config]}")
            continue
        lines.append(
            f"{config:<13}{med(runs, lambda r: r.wall_s):>8.2f}s"
            f"{med(runs, lambda r: r.generated_tok_s):>11.1f}"
            f"{med(runs, lambda r: r.prompt_tok_s):>14.1f}"
            f"{med(runs, lambda r: float(r.cached_tokens)):>8.0f}"
        )
    return "\n".join(lines)


def ratio_lines(chat: dict[str, list[RunResult]], zero: dict[str, list[RunResult]]) -> list[str]:
    def ttft(c: str) -> float | None:
        return med(chat[c], lambda r: r.mean_ttft_s) if chat[c] else None

    def thr(c: str) -> float | None:
        return med(zero[c], lambda r: 1.0 / r.wall_s) if zero[c] else None

    def line(label: str, num: float | None, den: float | None, target: str) -> str:
        value = f"{num / den:.2f}x" if num is not None and den else "n/a"
        return f"  {label:<48}{value:>7}   (target {target})"

    return [
        "ratios (medians):",
        line("kvoffload mean TTFT / no offload", ttft("kvoffload"), ttft("no-offload"), "<= 0.30"),
        line(
            "kvoffload mean TTFT / vLLM connector",
            ttft("kvoffload"),
            ttft("vllm-offload"),
            "<= 1.00",
        ),
        line(
            "kvoffload zero-reuse throughput / no offload",
            thr("kvoffload"),
            thr("no-offload"),
            ">= 0.99",
        ),
        line(
            "vLLM connector mean TTFT / no offload",
            ttft("vllm-offload"),
            ttft("no-offload"),
            "reference",
        ),
        line(
            "vLLM connector zero-reuse throughput / no off.",
            thr("vllm-offload"),
            thr("no-offload"),
            "reference",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny model, small workload (<1 min)")
    parser.add_argument("--runs", type=int, default=None, help="runs per configuration")
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM async scheduling")
    parser.add_argument("--users", type=int, default=None, help="chat users (default 8)")
    parser.add_argument("--turns", type=int, default=None, help="chat turns (default 14; 3 quick)")
    args = parser.parse_args(argv)
    setup = make_setup(args.quick, args.runs, args.async_scheduling, args.users, args.turns)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is first imported
    ensure_model(setup.chat.preset)

    available: dict[str, str | None] = {c: None for c in CONFIGS}
    reason = kvoffload_unavailable()
    if reason is not None:
        available["kvoffload"] = f"kvoffload connector not available yet ({reason})"
    started = time.perf_counter()
    chat = measure(setup, "chat", turn_batches(setup.chat.workload.requests()), available)
    zero = measure(setup, "zero reuse", setup.zero_batches(), available)

    c, z = setup.chat.workload, setup.zero
    kv_tokens = setup.chat.kv_cache_tokens()
    print(
        f"\nmodel {setup.chat.preset!r}, float32, block 32, 1 torch thread; engine KV "
        f"{kv_tokens} tokens ({kv_tokens / c.working_set_tokens():.0%} of the chat working set "
        f"{c.working_set_tokens()}); host tier {setup.chat.host_bytes() >> 20} MiB; "
        f"{setup.runs} run(s), medians; async scheduling {setup.async_scheduling}"
    )
    print(
        f"\nchat: {c.users} users x {c.turns} turns, system prompt {c.system_tokens}, "
        f"messages {c.user_tokens[0]}-{c.user_tokens[1]}, answers {c.output_tokens} tokens"
    )
    print(chat_table(chat, available))
    print(
        f"\nzero reuse: {z.users} unique prompts of {z.user_tokens[0]}-{z.user_tokens[1]} tokens, "
        f"{z.output_tokens} generated each, {ZERO_BATCHES} batches (wall: all of them)"
    )
    print(zero_table(zero, available))
    print()
    print("\n".join(ratio_lines(chat, zero)))
    print(f"\nbenchmark took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    sys.exit(main())
