"""The "chat" and "zero" workloads of ``bench/e2e.py``: the demo's multi-turn chat
and a zero-reuse batch on one engine, no offload vs vLLM's connector vs kvoffload."""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace

from e2e_common import identical, med, mismatches, per_round_ratio
from kvoffload.demos.chat_demo import ChatSetup, kvoffload_config
from kvoffload.demos.chat_demo import make_setup as make_chat_setup
from kvoffload.demos.tiny_model import PRESETS
from kvoffload.demos.vllm_runner import EngineSpec, RunResult, run
from kvoffload.workload.chat import ChatRequest, ChatWorkload

CONFIGS = ("no-offload", "vllm-offload", "kvoffload")
ZERO_BATCHES = 5


@dataclass(frozen=True)
class Setup:
    chat: ChatSetup  # the model, the chat workload and the cache sizes
    zero: ChatWorkload
    runs: int
    zero_pairs: int
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


def make_setup(args: argparse.Namespace) -> Setup:
    """The demo's chat (``kvoffload demo``) and a zero-reuse batch on the same engine."""
    chat = make_chat_setup(args.quick, args.users, args.turns)
    vocab = PRESETS[chat.preset].vocab_size
    runs = args.runs or (1 if args.quick else 3)
    pairs = args.zero_pairs or (1 if args.quick else 5)
    if args.quick:
        zero = ChatWorkload(8, 1, 0, (64, 160), 16, vocab=vocab, seed=2)
    else:
        zero = ChatWorkload(8, 1, 0, (128, 320), 32, vocab=vocab, seed=2)
    return Setup(chat, zero, runs, pairs, args.async_scheduling)


def measure(
    setup: Setup,
    label: str,
    workload: Sequence[Sequence[ChatRequest]],
    available: dict[str, str | None],
    *,
    rounds: int,
    alternate: bool = False,
) -> dict[str, list[RunResult]]:
    """Run ``workload`` ``rounds`` times per available configuration, interleaved
    (``alternate``: no-offload and kvoffload swap places every other round).

    A configuration that raises is marked unavailable (its reason recorded in
    ``available``) and skipped from then on.
    """
    results: dict[str, list[RunResult]] = {c: [] for c in CONFIGS}
    for i in range(rounds):
        order = list(CONFIGS)
        if alternate and i % 2:
            order = ["kvoffload", "vllm-offload", "no-offload"]
        for config in order:
            if available[config] is not None:
                continue
            start = time.perf_counter()
            try:
                results[config].append(run(setup.engine(config), workload))
                took = time.perf_counter() - start
                print(f"  {label} run {i + 1}/{rounds} {config}: {took:.0f} s", flush=True)
            except Exception as exc:
                traceback.print_exc()
                available[config] = f"failed: {type(exc).__name__}: {exc}"
    return results


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
            f"{identical(base, runs):>13}"
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


def ratio_lines(chat: dict[str, list[RunResult]]) -> list[str]:
    def ttft(c: str) -> float | None:
        return med(chat[c], lambda r: r.mean_ttft_s) if chat[c] else None

    def line(label: str, num: float | None, den: float | None, goal: str) -> str:
        value = f"{num / den:.2f}x" if num is not None and den else "n/a"
        return f"  {label:<48}{value:>7}   ({goal})"

    k, n, v = ttft("kvoffload"), ttft("no-offload"), ttft("vllm-offload")
    return [
        "chat ratios (medians):",
        line("kvoffload mean TTFT / no offload", k, n, "target <= 0.30"),
        line("kvoffload mean TTFT / vLLM connector", k, v, "target <= 1.00"),
        line("vLLM connector mean TTFT / no offload", v, n, "reference"),
    ]


def zero_ratio(zero: dict[str, list[RunResult]], config: str) -> float | None:
    """Median over rounds of ``config``'s zero-reuse throughput / no offload's."""
    thr = {c: [1.0 / r.wall_s for r in zero[c]] for c in (config, "no-offload")}
    return per_round_ratio(thr[config], thr["no-offload"])


def chat_ok(results: dict[str, list[RunResult]]) -> bool:
    base = results["no-offload"][0] if results["no-offload"] else None
    bad = [c for c in CONFIGS if base and results[c] and mismatches(base, results[c])[0]]
    for c in bad:
        print(f"!!! OUTPUT MISMATCH (chat): {c} differs from no-offload")
    return not bad
