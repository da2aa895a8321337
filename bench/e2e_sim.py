"""The simulator's prediction for the "tiers" workload (``bench/e2e_tiers.py``): hit
tokens and hit rates of the same requests under the same engine and kvoffload
settings, next to what the real engine measured (issue 14: within 10%).

Trace: the benchmark's own :class:`~kvoffload.workload.chat.ChatWorkload` requests
in the simulator's token-id form (``TraceRequest.prompt`` = the prompt the engine
gets), so blocks hash alike exactly when the engine's do. A request's output is its
own content: the engine generates its answer, the next turn's prompt carries the
workload's synthetic one, so a turn shares with the user's previous turn only the
whole blocks of that turn's prompt, in the simulator as in vLLM. Arrivals follow
``demos/vllm_runner.run_batches``: each turn (``turn_batches``) is one ``generate``
call, submitted at once after the previous turn finished, so turn ``k`` arrives at
``k * TURN_GAP_S``, far beyond the time a turn takes in simulated seconds, and the
requests of a turn queue in the engine's submission order. The engine's two
warm-up requests are not simulated (their blocks, of a token no workload prompt
has, are the first the caches evict; their hits are outside the measured counts).

Settings (:func:`sim_config`): the engine's block and chunk (one chunk per block:
``chunk_tokens`` unset), its usable KV (the configured tokens less vLLM's null
block), ``max_num_seqs`` and ``max_num_batched_tokens`` (unset in the EngineSpec:
vLLM's default), prefix caching, one decode token per step as vLLM; the
configuration's host, disk (its slot count: files pad each chunk) and Redis
(``maxmemory`` over the value size) capacities, the model's KV bytes per token, and
kvoffload's defaults for every option the benchmark does not set (eviction,
store_threshold, lower_tier_admission, lower_tier_loads, deferral bounds). The cost
model keeps the simulator's defaults (bytes per token aside). Timing matters only
where copies overlap compute (a lookup while a chunk's store is in flight, host slots
held by spills): the predictions are the same with compute 100x slower than those
defaults, the CPU engine's regime (copies far faster than prefilling a chunk), and
lower for the host10 configurations with compute 100x faster.

Hit tokens are counted as vLLM's ``prefix_cache_hits`` / ``external_prefix_cache_hits``
count them: once per request, at its first admission (vLLM keeps re-admissions after
a preemption apart too). Hit rate = (engine + connector hit tokens) / prompt tokens.

Usage: ``python bench/e2e_sim.py [--quick] [--users N] [--turns N]`` prints the
predicted table for the benchmark's setup (no engine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e2e_tiers import KVOFFLOAD, MAX_RUNNING, REFERENCE, Results, TierSetup, make_setup
from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.core.config.options import OPTIONS
from kvoffload.demos.chat_demo import BLOCK
from kvoffload.demos.vllm_runner import RunResult, turn_batches
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.runner import SimConfig, run_simulation
from kvoffload.simulate.trace import TraceRequest
from kvoffload.tiers.disk import slot_bytes
from kvoffload.workload.chat import ChatWorkload

SIMULATED = (REFERENCE, *KVOFFLOAD, "no-offload")
TURN_GAP_S = 1000.0  # simulated seconds between turns (a turn takes about a second)
# vLLM's max_num_batched_tokens for the offline LLM class on CPU (EngineSpec leaves it
# unset; vLLM's get_batch_defaults); 4 running requests never reach it.
TOKEN_BUDGET = 4096
TOLERANCE = 0.10  # |predicted / measured - 1| of the hit rate


def _default(name: str) -> Any:
    return next(o.default for o in OPTIONS if o.name == name)


def trace(workload: ChatWorkload, gap_s: float = TURN_GAP_S) -> list[TraceRequest]:
    """The workload's requests as the engine gets them, turn ``k`` at ``k * gap_s``."""
    return [
        TraceRequest(
            turn * gap_s,
            r.output_tokens,
            prompt=r.prompt,
            where=f"turn {r.turn} user {r.user}",
        )
        for turn, batch in enumerate(turn_batches(workload.requests()))
        for r in batch
    ]


def sim_config(setup: TierSetup, config: str) -> SimConfig:
    """The simulator's settings for one of :data:`SIMULATED` (see the module docstring)."""
    if config not in SIMULATED:
        raise ValueError(f"config: {config!r} is not simulated; accepted: {SIMULATED}")
    tokens = setup.big_tokens() if config == REFERENCE else setup.small_tokens()
    chunk = setup.chunk_bytes
    cpu = disk = redis = 0
    if config == "host-big":
        cpu = setup.host_big()
    elif config.startswith("host10"):
        cpu = setup.host_small()
        if config.endswith("disk"):
            disk = setup.host_big() // slot_bytes(chunk) * chunk  # the tier's slots
        else:
            redis = setup.redis_maxmemory() // (HEADER_BYTES + chunk) * chunk
    return SimConfig(
        cpu_bytes=cpu,
        tier_bytes={"disk": disk, "redis": redis},
        eviction=_default("eviction"),
        store_threshold=_default("store_threshold"),
        lower_tier_admission=_default("lower_tier_admission"),
        lower_tier_loads=_default("lower_tier_loads"),
        engine_tokens=tokens - BLOCK,  # vLLM keeps one block back (the null block)
        block_size=BLOCK,
        chunk_tokens=BLOCK,
        token_budget=TOKEN_BUDGET,
        max_running=MAX_RUNNING,
        decode_stride=1,
        prefix_caching=True,
        max_deferral_steps=_default("max_deferral_steps"),
        max_deferral_seconds=_default("max_deferral_seconds"),
        cost=CostModel(bytes_per_token=setup.token_bytes),
    )


def predict(setup: TierSetup, configs: Sequence[str] = SIMULATED) -> dict[str, SimResult]:
    """One simulation per config (deterministic: one per benchmark is enough)."""
    requests = trace(setup.workload)
    out = {}
    for config in configs:
        result = run_simulation(sim_config(setup, config), requests)
        last_turn = (setup.workload.turns - 1) * TURN_GAP_S
        if result.simulated_s - last_turn >= TURN_GAP_S:  # turns would overlap
            raise RuntimeError(f"{config}: a turn took {result.simulated_s - last_turn:.0f} s")
        out[config] = result
    return out


def hit_rate(engine: float, connector: float, prompt: float) -> float:
    return (engine + connector) / prompt if prompt else 0.0


def _measured(runs: Sequence[RunResult]) -> tuple[float, float, float] | None:
    """Medians over runs of (engine hit tokens, connector hit tokens, hit rate)."""
    if not runs:
        return None
    return (
        statistics.median(r.local_hit_tokens for r in runs),
        statistics.median(r.external_hit_tokens for r in runs),
        statistics.median(
            hit_rate(r.local_hit_tokens, r.external_hit_tokens, r.prompt_tokens) for r in runs
        ),
    )


def table(predicted: dict[str, SimResult], res: Results | None = None) -> list[str]:
    """Predicted hits per config and, with ``res``, the measured ones (medians over
    runs) and the hit rates' ratio, PASS within :data:`TOLERANCE`."""
    m_head = "measured" if res is not None else ""
    lines = [
        f"  {'config':<16}{'engine hits':>12}{m_head:>10}{'connector hits':>16}{m_head:>10}"
        f"{'hit rate':>10}{m_head:>10}{'pred/meas' if res is not None else '':>11}"
    ]
    configs = list(predicted)
    if res is not None:
        configs += [c for c in res.configs if c not in predicted]
    prompts = {p.prompt_tokens for p in predicted.values()}
    for c in configs:
        p = predicted.get(c)
        if p is None:
            lines.append(f"  {c:<16}not simulated (not kvoffload's policy)")
            continue
        rate = hit_rate(p.engine_hit_tokens, p.kvoffload_hit_tokens, p.prompt_tokens)
        cells = [f"{p.engine_hit_tokens:>12}", f"{p.kvoffload_hit_tokens:>16}", f"{rate:>10.1%}"]
        if res is None:
            lines.append(f"  {c:<16}" + "".join(cells))
            continue
        runs = res.runs.get(c, [])
        prompts.update(r.prompt_tokens for r in runs)
        m = _measured(runs)
        if m is None:
            na = f"{'n/a':>10}"
            why = res.failed.get(c, "did not run")
            lines.append(f"  {c:<16}{cells[0]}{na}{cells[1]}{na}{cells[2]}{na}   (engine: {why})")
            continue
        ratio = rate / m[2] if m[2] else None
        verdict = f"{'n/a':>11}"
        if ratio is not None:
            verdict = f"{ratio:>10.3f}x  {'PASS' if abs(ratio - 1) <= TOLERANCE else 'FAIL'}"
        lines.append(
            f"  {c:<16}{cells[0]}{m[0]:>10.0f}{cells[1]}{m[1]:>10.0f}{cells[2]}{m[2]:>10.1%}"
            + verdict
        )
    first = next(iter(predicted.values()), None)
    if first is not None:
        differ = "" if len(prompts) == 1 else f"; !!! prompt tokens differ: {sorted(prompts)}"
        lines.append(
            f"  ({first.requests} requests, {first.prompt_tokens} prompt tokens{differ}; hit "
            "rate = (engine + connector hit tokens) / prompt tokens"
            + (
                f"; pred/meas: of the hit rates, PASS within {TOLERANCE:.0%})"
                if res is not None
                else ")"
            )
        )
    return lines


def report_lines(setup: TierSetup, res: Results) -> list[str]:
    """The report's section: a header line and the table (one simulation per config)."""
    predicted = predict(setup, [c for c in SIMULATED if c in res.configs])
    return [
        "simulator's prediction (kvoffload simulate, same requests and settings) vs measured "
        "(median over runs):",
        *table(predicted, res),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the --quick tiers workload")
    parser.add_argument("--users", type=int, default=None, help="chat users (16)")
    parser.add_argument("--turns", type=int, default=None, help="chat turns (6; quick 2)")
    args = parser.parse_args(argv)
    setup = make_setup(args.quick, None, args.users, args.turns, Path("."))
    w = setup.workload
    print(
        f"tiers, predicted: {w.users} users x {w.turns} turns, system prompt {w.system_tokens}, "
        f"messages {w.user_tokens[0]}-{w.user_tokens[1]}, answers {w.output_tokens}; "
        f"small engine KV {setup.small_tokens()} tokens, never-evicting {setup.big_tokens()}; "
        f"{setup.token_bytes} B/token"
    )
    print("\n".join(table(predict(setup))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
