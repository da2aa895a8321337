"""``vllm serve`` + ``vllm bench serve``: no connector vs vLLM's OffloadingConnector vs kvoffload.

The same model, engine and workload for every configuration; only the KV connector
differs:
- ``none``: vLLM with its own prefix cache only;
- ``vllm-offload``: vLLM's native OffloadingConnector with the CPU copy spec of
  ``vllm_cpu_offload_spec.py`` (the baseline; ``bench/`` goes on the servers'
  ``PYTHONPATH``);
- ``kvoffload``: kvoffload's connector, named by ``kv_connector`` alone (the
  ``vllm.general_plugins`` entry point registers it).

Both connectors get the same host capacity, enough for the whole working set. The
engine's KV cache (``--kv-cache-memory-bytes``, the same for all) holds only a
fraction of the prefixes, so a prefix seen before is usually evicted from the engine
by the time it comes back and only an offload tier can serve it.

Workload: ``vllm bench serve --backend openai --dataset-name prefix_repetition``:
``num_prefixes`` random prefixes, each followed by ``num_prompts / num_prefixes``
different random suffixes, shuffled, sent one at a time (``--max-concurrency 1``, so
TTFT is prefill time, not queueing), greedy, ``--ignore-eos``; the same seed for
every configuration. A tokenizer is written next to the model by
``kvoffload.testing.vllm_server.write_tokenizer`` (random ids round-trip exactly).

Each (round, configuration) gets a fresh server (no offloaded state carries over);
configurations are interleaved within each round; the table shows the median over
rounds of each run's mean and median TTFT, vLLM's local and connector prefix-cache
hit tokens (from ``/metrics``), and the ratios against no connector. One short
request warms each server up before the benchmark. A run with failed requests is
reported and left out of the medians.

Usage: ``python bench/serve.py [--quick] [--rounds N] [--model PRESET_OR_DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.demos.tiny_model import PRESETS, ensure_model, kv_bytes_per_token
from kvoffload.testing.vllm_server import (
    ServerError,
    VllmServer,
    token_text,
    vllm_executable,
    write_tokenizer,
)

BENCH_DIR = Path(__file__).resolve().parent
CONFIGS = ("none", "vllm-offload", "kvoffload")
BLOCK = 32


@dataclass(frozen=True)
class Workload:
    """``vllm bench serve``'s prefix_repetition options, and the engine around them."""

    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int
    num_prompts: int
    engine_kv_tokens: int  # the engine's KV cache, in tokens (a multiple of BLOCK)
    max_model_len: int
    seed: int = 0

    def working_set_tokens(self) -> int:
        """Prefix tokens plus every prompt's suffix and output: what would need caching."""
        return self.num_prefixes * self.prefix_len + self.num_prompts * (
            self.suffix_len + self.output_len
        )

    def bench_args(self) -> list[str]:
        return [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(self.prefix_len),
            "--prefix-repetition-suffix-len",
            str(self.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(self.num_prefixes),
            "--prefix-repetition-output-len",
            str(self.output_len),
            "--num-prompts",
            str(self.num_prompts),
            "--seed",
            str(self.seed),
        ]


# Default (demo model, 24 KiB of KV per token): 8 prefixes of 512 tokens, 4 prompts
# each; the engine holds 1280 tokens (~2 prompts, 19% of the working set).
DEFAULT = Workload(512, 64, 8, 16, 32, engine_kv_tokens=1280, max_model_len=1024)
# Quick (tiny model): the same shape, halved; the engine holds ~2 prompts.
QUICK = Workload(256, 32, 8, 8, 32, engine_kv_tokens=640, max_model_len=512)


@dataclass
class RunResult:
    """One ``vllm bench serve`` run against one fresh server."""

    config: str
    round: int
    mean_ttft_ms: float
    median_ttft_ms: float
    completed: int
    failed: int
    duration_s: float
    local_hit_tokens: float  # vllm:prefix_cache_hits_total after the run
    connector_hit_tokens: float  # vllm:external_prefix_cache_hits_total
    extra: dict[str, Any] = field(default_factory=dict)


def prepare_model(model: str, workdir: Path) -> tuple[Path, int]:
    """A directory vLLM can serve (the checkpoint plus a tokenizer) and its KV bytes/token.

    ``model`` is a preset of ``kvoffload.demos.tiny_model`` or a checkpoint directory.
    The checkpoint's files are symlinked into ``workdir`` next to the written
    tokenizer, so neither the model cache nor the given directory is modified.
    """
    if model in PRESETS:
        source = ensure_model(model)
    else:
        source = Path(model).resolve()
        if not (source / "config.json").is_file():
            raise SystemExit(
                f"--model: {model!r} is neither a preset {sorted(PRESETS)} nor a "
                "checkpoint directory with a config.json"
            )
    config = json.loads((source / "config.json").read_text())
    served = workdir / "model"
    served.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if not item.name.startswith("tokenizer") and item.name != "chat_template.jinja":
            link = served / item.name
            if not link.exists():
                link.symlink_to(item)
    write_tokenizer(served, int(config["vocab_size"]))
    return served, kv_bytes_per_token_of(config, model)


def kv_bytes_per_token_of(config: dict[str, Any], model: str) -> int:
    """float32 KV bytes per token from a Llama-style config (the preset's formula if any)."""
    if model in PRESETS:
        return kv_bytes_per_token(model)
    heads = int(config.get("num_key_value_heads", config["num_attention_heads"]))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return int(config["num_hidden_layers"]) * 2 * heads * head_dim * 4


def transfer_config(config: str, host_bytes: int) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of one configuration (None: no connector)."""
    if config == "none":
        return None
    if config == "vllm-offload":
        from vllm_cpu_offload_spec import spec_config  # bench/ is on sys.path; imports vllm

        return spec_config(host_bytes)
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": host_bytes},
    }


def server_env(config: str) -> dict[str, str]:
    """``bench/`` on the baseline's server path (its spec module lives there); nothing
    for the others (``bench/`` holds modules named like common ones)."""
    if config != "vllm-offload":
        return {}
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(BENCH_DIR) + (os.pathsep + path if path else "")}


def warm_up(server: VllmServer, vocab: int) -> None:
    """One short completion, so the first benchmark request pays no first-call costs.
    Its 40 tokens share no block hash with the benchmark's random prompts (hashes
    chain from the first token), so it leaves nothing the benchmark can hit."""
    body = json.dumps(
        {
            "model": server.model,
            "prompt": " ".join(token_text(vocab - 1 - i) for i in range(40)),
            "max_tokens": 4,
            "temperature": 0,
        }
    ).encode()
    request = urllib.request.Request(
        server.base_url + "/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def prefix_cache_hits(server: VllmServer) -> tuple[float, float]:
    """(local, connector) prefix-cache hit tokens from vLLM's ``/metrics``."""
    local = external = 0.0
    for line in server.get("/metrics").splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            local += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:external_prefix_cache_hits_total"):
            external += float(line.rsplit(" ", 1)[1])
    return local, external


@dataclass(frozen=True)
class Setup:
    """What every run shares: the served model directory, the workload, the sizes."""

    model: Path
    vocab: int
    workload: Workload
    host_bytes: int  # each connector's host tier
    kv_bytes_token: int
    cores: str  # VLLM_CPU_OMP_THREADS_BIND
    workdir: Path  # logs and result files


def run_one(setup: Setup, config: str, round_: int) -> RunResult:
    """Start a fresh server for ``config``, benchmark it, stop it."""
    tag = f"{config}-r{round_}"
    transfer = transfer_config(config, setup.host_bytes)
    serve_args = [] if transfer is None else ["--kv-transfer-config", json.dumps(transfer)]
    server = VllmServer(
        setup.model,
        setup.workdir / f"{tag}.serve.log",
        serve_args,
        env=server_env(config),
        kv_cache_bytes=setup.workload.engine_kv_tokens * setup.kv_bytes_token,
        max_model_len=setup.workload.max_model_len,
        cores=setup.cores,
    )
    with server:
        print(f"  {tag}: server ready in {server.elapsed_s():.0f} s", flush=True)
        warm_up(server, setup.vocab)
        before_local, before_external = prefix_cache_hits(server)
        result_name = f"{tag}.json"
        command = [
            str(vllm_executable()),
            "bench",
            "serve",
            "--backend",
            "openai",
            "--base-url",
            server.url,
            "--model",
            str(setup.model),
            "--tokenizer",
            str(setup.model),
            *setup.workload.bench_args(),
            "--max-concurrency",
            "1",
            "--request-rate",
            "inf",
            "--temperature",
            "0",
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(setup.workdir),
            "--result-filename",
            result_name,
        ]
        started = time.monotonic()
        with (setup.workdir / f"{tag}.bench.log").open("wb") as log:
            done = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, timeout=3600, check=False
            )
        if done.returncode != 0:
            tail = "\n".join((setup.workdir / f"{tag}.bench.log").read_text().splitlines()[-30:])
            raise RuntimeError(f"vllm bench serve exited {done.returncode}:\n{tail}")
        after_local, after_external = prefix_cache_hits(server)
    result = json.loads((setup.workdir / result_name).read_text())
    print(
        f"  {tag}: mean TTFT {result['mean_ttft_ms']:.1f} ms, "
        f"{result['completed']} completed, {result['failed']} failed, "
        f"bench {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return RunResult(
        config,
        round_,
        float(result["mean_ttft_ms"]),
        float(result["median_ttft_ms"]),
        int(result["completed"]),
        int(result["failed"]),
        float(result["duration"]),
        after_local - before_local,
        after_external - before_external,
        {k: result.get(k) for k in ("total_input_tokens", "total_output_tokens")},
    )


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(results: dict[str, list[RunResult]], problems: dict[str, list[str]]) -> str:
    good = {c: [r for r in results[c] if r.failed == 0 and r.completed > 0] for c in CONFIGS}
    lines = [
        f"{'config':<14}{'runs':>5}{'mean TTFT':>11}{'median TTFT':>13}{'duration':>10}"
        f"{'engine hits':>13}{'connector hits':>16}{'failed':>8}"
    ]
    for c in CONFIGS:
        runs = good[c]
        failed = sum(r.failed for r in results[c])
        if not runs:
            lines.append(f"{c:<14}  no good run: {'; '.join(problems[c]) or 'failed requests'}")
            continue

        def med(attr: str, runs: list[RunResult] = runs) -> float:
            return statistics.median(float(getattr(r, attr)) for r in runs)

        lines.append(
            f"{c:<14}{len(runs):>5}{med('mean_ttft_ms'):>9.1f}ms{med('median_ttft_ms'):>11.1f}ms"
            f"{med('duration_s'):>9.1f}s{med('local_hit_tokens'):>13.0f}"
            f"{med('connector_hit_tokens'):>16.0f}{failed:>8}"
        )
    ttft = {c: median([r.mean_ttft_ms for r in good[c]]) for c in CONFIGS}

    def ratio(label: str, num: str, den: str) -> str:
        a, b = ttft[num], ttft[den]
        value = f"{a / b:.2f}x" if a is not None and b else "n/a"
        return f"  {label:<40}{value:>7}"

    lines += [
        "",
        "ratios of median mean-TTFT:",
        ratio("kvoffload / none", "kvoffload", "none"),
        ratio("kvoffload / vLLM's OffloadingConnector", "kvoffload", "vllm-offload"),
        ratio("vLLM's OffloadingConnector / none", "vllm-offload", "none"),
    ]
    for c in CONFIGS:
        for p in problems[c]:
            lines.append(f"problem: {c}: {p}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny model, small workload")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the configurations")
    parser.add_argument(
        "--model", default=None, help="a preset (tiny, demo) or a checkpoint directory"
    )
    parser.add_argument(
        "--cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND of the servers (default 0)"
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="logs and results (kept)")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; accepted: {list(CONFIGS)}")
    workload = QUICK if args.quick else DEFAULT
    model_name = args.model or ("tiny" if args.quick else "demo")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvoffload-bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    model, kv_bytes_token = prepare_model(model_name, workdir)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    host_bytes = 2 * workload.working_set_tokens() * kv_bytes_token  # everything fits
    setup = Setup(model, vocab, workload, host_bytes, kv_bytes_token, args.cores, workdir)
    print(
        f"model {model_name!r} ({kv_bytes_token} B of KV per token, float32, block {BLOCK}); "
        f"engine KV {workload.engine_kv_tokens} tokens = "
        f"{workload.engine_kv_tokens / workload.working_set_tokens():.0%} of the working set "
        f"({workload.working_set_tokens()} tokens); host tier {host_bytes >> 20} MiB per "
        f"connector\nworkload: {workload.num_prefixes} prefixes x {workload.prefix_len} tokens, "
        f"{workload.num_prompts} prompts (suffix {workload.suffix_len}, output "
        f"{workload.output_len}), one at a time; {args.rounds} round(s); "
        f"cores {args.cores!r}; logs in {workdir}",
        flush=True,
    )
    results: dict[str, list[RunResult]] = {c: [] for c in CONFIGS}
    problems: dict[str, list[str]] = {c: [] for c in CONFIGS}
    for round_ in range(1, args.rounds + 1):
        for config in configs:
            try:
                result = run_one(setup, config, round_)
            except (ServerError, RuntimeError, OSError, subprocess.SubprocessError) as exc:
                problems[config].append(f"round {round_}: {type(exc).__name__}: {exc}")
                print(f"  {config}-r{round_}: FAILED: {exc}", flush=True)
                continue
            results[config].append(result)
            if result.failed or result.completed != workload.num_prompts:
                problems[config].append(
                    f"round {round_}: {result.failed} failed, {result.completed} completed"
                )
    print()
    print(report(results, problems))
    print(f"\nbenchmark took {time.monotonic() - started:.0f} s")
    return 0 if not any(problems[c] for c in configs) else 1


if __name__ == "__main__":
    sys.exit(main())
