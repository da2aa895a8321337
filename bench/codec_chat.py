"""The capped chat with a chunk codec: kvoffload's host tier at a share of the chat's
working set, ``codec: none`` against ``codec: fp8`` (issue 33's real-engine figure).

The demo's multi-turn chat (``kvoffload.demos.chat_demo``: users' turns extend their
history, one batch per turn) on one in-process vLLM engine whose KV cache holds a
quarter of the working set, with kvoffload's host memory at ``--host-share`` of the
working set's raw KV bytes (default 5%). Configurations, interleaved over ``--rounds``
(order alternating), each on a fresh engine: ``no-offload`` (the reference outputs),
``none`` and ``fp8``. Prints per configuration the median over rounds of the prompt
tokens served from kvoffload, the mean TTFT and the requests whose outputs equal the
reference's, and the ratios fp8 / none.

    PYTHONPATH=src python bench/codec_chat.py [--dtype bfloat16] [--host-share 0.05]
        [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from kvoffload.demos.chat_demo import kvoffload_config, make_setup
from kvoffload.demos.tiny_model import kv_bytes_per_token
from kvoffload.demos.vllm_runner import RunResult, run, turn_batches
from kvoffload.workload.chat import ChatRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host-share", type=float, default=0.05)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="the tiny model, a small chat")
    args = parser.parse_args()
    setup = make_setup(args.quick, None, None)
    requests: list[ChatRequest] = setup.workload.requests()
    batches = [list(b) for b in turn_batches(requests)]
    working = setup.workload.working_set_tokens() * kv_bytes_per_token(setup.preset)
    host = max(1, int(working * args.host_share))
    if args.dtype != "float32":  # kv_bytes_per_token is float32's: the same share of bf16 KV
        host //= 2
    configs = {
        "no-offload": None,
        "none": kvoffload_config(host),
        "fp8": _with_codec(kvoffload_config(host), "fp8"),
    }
    results: dict[str, list[RunResult]] = {name: [] for name in configs}
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            spec = replace(setup.engine(configs[name]), dtype=args.dtype)
            results[name].append(run(spec, batches))
    reference = [req.token_ids for req in results["no-offload"][0].requests]
    print(f"chat: {len(requests)} requests, working set {working / 2**20:.1f} MiB (float32 KV), "
          f"host tier {host / 2**20:.2f} MiB ({100 * args.host_share:.0f}%), dtype {args.dtype}, "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"{'config':<11} {'kvoffload hit tokens':>21} {'mean TTFT ms':>13} {'same outputs':>13}")
    summary = {}
    for name, runs in results.items():
        hits = statistics.median(x.external_hit_tokens for x in runs)
        ttft = statistics.median(x.mean_ttft_s for x in runs) * 1e3
        same = min(sum(a.token_ids == b for a, b in zip(x.requests, reference, strict=True))
                   for x in runs)  # fmt: skip
        summary[name] = (hits, ttft)
        print(f"{name:<11} {hits:>21.0f} {ttft:>13.1f} {same:>8}/{len(reference)}")
    (h0, t0), (h1, t1) = summary["none"], summary["fp8"]
    print(f"fp8 / none: hit tokens {h1 / max(h0, 1):.2f}x, mean TTFT {t1 / t0:.2f}x")


def _with_codec(config: dict[str, object], codec: str) -> dict[str, object]:
    extra = dict(config["kv_connector_extra_config"])  # type: ignore[call-overload]
    return {**config, "kv_connector_extra_config": {**extra, "codec": codec}}


if __name__ == "__main__":
    main()
