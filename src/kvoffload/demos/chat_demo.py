"""The kvoffload demo: a multi-turn chat on a real vLLM engine, without and with kvoffload.

``main(argv)`` makes sure the random ~100M-parameter ``demo`` Llama exists
(written once under ``~/.cache/kvoffload/models``), then runs the same chat
workload twice on an in-process vLLM engine: once with no offloading and once
with kvoffload's connector. Every user shares a system prompt and each turn
resends the whole conversation; the engine's KV cache holds only about a quarter
of all histories, so without offloading most of every history is recomputed,
while kvoffload loads it back from host memory. It prints a table (time to first
token p50/p90, throughput, tokens served from kvoffload) and writes a PNG chart
of mean TTFT per turn.

If kvoffload's connector (``kvoffload.vllm``) cannot be imported, or fails, only
the no-offload side is run and reported, and the output says so.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.demos.tiny_model import (
    PRESETS,
    ensure_model,
    is_complete,
    kv_bytes_per_token,
    model_dir,
)
from kvoffload.demos.vllm_runner import (
    EngineSpec,
    RequestResult,
    RunResult,
    open_engine,
    run_batches,
    turn_batches,
    warm_up,
)
from kvoffload.workload.chat import ChatWorkload

BLOCK = 32
KVOFFLOAD_MODULE = "kvoffload.vllm"
KVOFFLOAD_CONNECTOR = "KVOffloadConnector"


def kvoffload_config(cpu_bytes: int) -> dict[str, Any]:
    """``kv_transfer_config`` for kvoffload's connector with ``cpu_bytes`` of host tier."""
    return {
        "kv_connector": KVOFFLOAD_CONNECTOR,
        "kv_connector_module_path": KVOFFLOAD_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": int(cpu_bytes)},
    }


def kvoffload_unavailable() -> str | None:
    """None if kvoffload's vLLM connector can be imported, else why not (one line)."""
    try:
        module = importlib.import_module(KVOFFLOAD_MODULE)
    except Exception as exc:  # any import-time failure means "not usable here"
        return f"cannot import {KVOFFLOAD_MODULE}: {type(exc).__name__}: {exc}"
    if not hasattr(module, KVOFFLOAD_CONNECTOR):
        return f"{KVOFFLOAD_MODULE} has no {KVOFFLOAD_CONNECTOR}"
    return None


@dataclass(frozen=True)
class ChatSetup:
    """A model preset and a chat workload; engine and host caches are sized from it.

    The engine KV cache holds ``kv_fraction`` of the working set (at least twice the
    longest request); the host tier of a connector holds the working set twice.
    """

    preset: str
    workload: ChatWorkload
    kv_fraction: float = 0.25

    def kv_cache_tokens(self) -> int:
        longest = max(len(r.prompt) + r.output_tokens for r in self.workload.requests())
        tokens = max(int(self.workload.working_set_tokens() * self.kv_fraction), 2 * longest)
        return -(-tokens // BLOCK) * BLOCK + BLOCK  # vLLM keeps one block back (null block)

    def host_bytes(self) -> int:
        return 2 * self.workload.working_set_tokens() * kv_bytes_per_token(self.preset)

    def engine(
        self, kv_transfer_config: Mapping[str, Any] | None, async_scheduling: bool = False
    ) -> EngineSpec:
        tokens = self.kv_cache_tokens()
        return EngineSpec(
            model=ensure_model(self.preset),
            kv_cache_memory_bytes=tokens * kv_bytes_per_token(self.preset),
            block_size=BLOCK,
            max_model_len=min(tokens - BLOCK, PRESETS[self.preset].max_position_embeddings),
            max_num_seqs=self.workload.users,
            async_scheduling=async_scheduling,
            kv_transfer_config=kv_transfer_config,
        )


def make_setup(quick: bool, users: int | None, turns: int | None) -> ChatSetup:
    """``quick``: the 2-layer test model and a small chat (a smoke test, seconds)."""
    preset = "tiny" if quick else "demo"
    vocab = PRESETS[preset].vocab_size
    if quick:
        chat = ChatWorkload(users or 8, turns or 3, 128, (32, 96), 8, vocab=vocab, seed=7)
    else:
        chat = ChatWorkload(users or 8, turns or 14, 256, (32, 64), 16, vocab=vocab, seed=7)
    return ChatSetup(preset, chat)


def prepare_model(preset: str) -> None:
    path = model_dir(preset)
    if is_complete(path, PRESETS[preset]):
        print(f"model: reusing {path}")
        return
    print(f"model: writing a random {preset!r} Llama to {path} (once; about 10 s) ...")
    start = time.perf_counter()
    ensure_model(preset)
    print(f"model: ready in {time.perf_counter() - start:.1f} s")


def run_side(setup: ChatSetup, label: str, with_kvoffload: bool) -> RunResult:
    """One full pass of the workload on a fresh engine, with a progress bar."""
    from tqdm import tqdm

    batches = turn_batches(setup.workload.requests())
    with tqdm(total=sum(len(b) for b in batches), desc=f"{label:<16}", unit="req") as bar:

        def progress(turn: int, done: Sequence[RequestResult]) -> None:
            mean = sum(r.ttft_s for r in done) / len(done)
            bar.set_postfix_str(f"turn {turn + 1}: mean TTFT {mean:.2f}s")
            bar.update(len(done))

        transfer = kvoffload_config(setup.host_bytes()) if with_kvoffload else None
        with open_engine(setup.engine(transfer)) as llm:
            warm_up(llm)
            return run_batches(llm, batches, progress)


def table(results: dict[str, RunResult]) -> str:
    lines = [
        f"{'':<17}{'TTFT p50':>9}{'TTFT p90':>10}{'mean TTFT':>11}{'gen tok/s':>11}"
        f"{'prompt tok/s':>14}  tokens served from kvoffload"
    ]
    for label, r in results.items():
        served = "-"
        if label != "without offload":
            share = r.external_hit_tokens / max(1, r.prompt_tokens)
            served = f"{r.external_hit_tokens:,} ({share:.0%} of prompt tokens)"
        lines.append(
            f"{label:<17}{r.ttft_percentile(0.5):>8.2f}s{r.ttft_percentile(0.9):>9.2f}s"
            f"{r.mean_ttft_s:>10.2f}s{r.generated_tok_s:>11.1f}{r.prompt_tok_s:>14.1f}  {served}"
        )
    return "\n".join(lines)


def chart(results: dict[str, RunResult], path: Path, title: str, turns: int) -> None:
    """Mean TTFT per turn, one line per run, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        per_turn = r.mean_ttft_per_batch()
        ax.plot(range(1, len(per_turn) + 1), per_turn, marker="o", label=label)
    ax.set_xticks(range(1, turns + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean time to first token (s)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code (0 also when only one side ran)."""
    parser = argparse.ArgumentParser(
        prog="kvoffload demo", description="multi-turn chat on vLLM, without and with kvoffload"
    )
    parser.add_argument("--output", type=Path, default=Path("kvoffload-demo.png"), help="chart")
    parser.add_argument("--users", type=int, default=None, help="concurrent chat users")
    parser.add_argument("--turns", type=int, default=None, help="turns per user")
    parser.add_argument("--quick", action="store_true", help="2-layer test model, tiny chat")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is first imported
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)  # "Triton not available"
    started = time.perf_counter()

    setup = make_setup(args.quick, args.users, args.turns)
    w = setup.workload
    prepare_model(setup.preset)
    kv_tokens = setup.kv_cache_tokens()
    print(
        f"chat: {w.users} users x {w.turns} turns, shared {w.system_tokens}-token system prompt, "
        f"messages of {w.user_tokens[0]}-{w.user_tokens[1]} tokens, {w.output_tokens}-token "
        f"answers; engine KV cache {kv_tokens} tokens = {kv_tokens / w.working_set_tokens():.0%} "
        f"of all histories ({w.working_set_tokens()} tokens)"
    )
    reason = kvoffload_unavailable()
    sides = [("without offload", False)]
    if reason is None:
        sides.append(("with kvoffload", True))
    else:
        print(f"kvoffload's vLLM connector is not available yet ({reason}):")
        print("running only the side without offloading.")

    results: dict[str, RunResult] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, with_kvoffload in sides:
            try:
                results[label] = run_side(setup, label, with_kvoffload)
            except Exception as exc:
                if not with_kvoffload:
                    raise
                print(f"kvoffload run failed ({type(exc).__name__}: {exc}); showing only the")
                print("side without offloading.")

    print()
    print(table(results))
    base, off = results.get("without offload"), results.get("with kvoffload")
    if base is not None and off is not None:
        same = sum(
            a.token_ids == b.token_ids for a, b in zip(base.requests, off.requests, strict=True)
        )
        print(
            f"\nmean TTFT {base.mean_ttft_s:.2f} s without offload, {off.mean_ttft_s:.2f} s with "
            f"kvoffload ({off.mean_ttft_s / max(base.mean_ttft_s, 1e-9):.2f}x); greedy outputs "
            f"identical in {same}/{len(base.requests)} requests (float32)"
        )
    title = f"{w.users} users x {w.turns} turns, {setup.preset} model, KV cache {kv_tokens} tokens"
    chart(results, args.output, title, w.turns)
    print(f"chart: {args.output.resolve()}")
    print(f"demo finished in {time.perf_counter() - started:.0f} s")
    return 0
