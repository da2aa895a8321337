"""``kvoffload codec-check``: what a lossy chunk codec does to a model's outputs, on the
operator's own model, before they turn it on (issue 33).

One in-process vLLM engine with kvoffload and the codec (host memory large enough for
every prompt, ``load_policy: always`` so that nothing is recomputed instead of loaded):

1. every prompt is answered once (greedy, with the sampled tokens' log-probabilities):
   the engine computes its KV itself, so these are the outputs without the codec;
   kvoffload stores the prompts' chunks, encoded;
2. vLLM's prefix cache is reset (``LLM.reset_prefix_cache``; kvoffload's tiers are
   kept), and every prompt is answered again: its prefix now comes back from host
   memory, decoded;
3. the two answers are compared (``codec_check_report.py``): the requests whose
   answers are identical (every generated token id), the per-token agreement
   (positions with the same token, up to each request's length), where the answers
   that differ first differ, and the log-probability deltas of the chosen tokens
   before each request's first difference (mean and largest).

The same is done first with ``codec: none``, as the control: loading exact KV instead
of computing it can itself change a low-precision model's outputs a little (a prefill
of the suffix alone rounds differently from one of the whole prompt); the codec's own
effect is the difference between the two lines.

The second pass must really load: it checks vLLM's connector hit counter and refuses
to report (exit status 2) when nothing came back from kvoffload. Prompts are random
token ids (``--prompts``, ``--prompt-tokens``) or a file of JSON lists of token ids,
one per line. Prints the model and the sample measured on (its architecture from
``config.json``; random weights when it is a checkpoint kvoffload's demos wrote), the
figures, and that they hold for this model, dtype and sample only; or ``--json``
(each codec's figures with the ``sample``).

    kvoffload codec-check MODEL [--codec fp8] [--prompts 16 --prompt-tokens 512]
        [--max-tokens 16] [--dtype float32] [--kv-cache-memory-bytes 1GiB]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvoffload.codec_check_report import (
    CAVEAT,
    RANDOM_CAVEAT,
    Answer,
    Report,
    Sample,
    compare,
    describe_model,
)
from kvoffload.core.errors import UsageError
from kvoffload.simulate.units import parse_bytes

__all__ = ["Answer", "Report", "compare", "main", "parse_bytes"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvoffload codec-check", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the model's directory")
    p.add_argument("--codec", default="fp8", choices=("fp8",))
    p.add_argument("--prompts", type=int, default=16, help="random prompts (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prompt-file", type=Path, help="JSON lists of token ids, one per line")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="the engine's dtype (default float32)")
    p.add_argument("--kv-cache-memory-bytes", default="256MiB", help="the engine's KV cache")
    p.add_argument(
        "--cpu-bytes", default="4GiB", help="kvoffload's host memory: every prompt must fit"
    )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    if args.prompt_file is not None:
        lines = args.prompt_file.read_text().splitlines()
        prompts = [json.loads(line) for line in lines if line.strip()]
        if not prompts or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
        ):
            raise UsageError(f"--prompt-file {args.prompt_file}: not JSON lists of token ids")
        return prompts
    try:
        config = json.loads((Path(args.model) / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"{args.model}: no config.json (give a model directory)") from None
    vocab = int(config["vocab_size"])
    rng = random.Random(args.seed)
    return [
        [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.prompts < 1 or args.prompt_tokens < 1 or args.max_tokens < 1:
        raise UsageError("--prompts, --prompt-tokens and --max-tokens must be positive")
    prompts = _prompts(args)
    sample = _sample(args, prompts)
    from kvoffload.demos.vllm_runner import EngineSpec, open_engine

    spec = EngineSpec(
        model=Path(args.model),
        kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes"),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=1,
        kv_transfer_config={
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes": parse_bytes(args.cpu_bytes, "--cpu-bytes"),
                "codec": args.codec,
                "load_policy": "always",
            },
        },
    )
    reports = []
    transfer = dict(spec.kv_transfer_config or {})
    for codec in ("none", args.codec):
        extra = {**transfer["kv_connector_extra_config"], "codec": codec}
        run = replace(spec, kv_transfer_config={**transfer, "kv_connector_extra_config": extra})
        with open_engine(run) as llm:
            before = _answers(llm, prompts, args.max_tokens)
            hits = _external_hits(llm)
            llm.reset_prefix_cache()
            after = _answers(llm, prompts, args.max_tokens)
            loaded = _external_hits(llm) - hits
        if loaded <= 0:
            why = "nothing was loaded from kvoffload in the second pass (--cpu-bytes too small?)"
            print(f"kvoffload codec-check: codec {codec}: {why}", file=sys.stderr)
            return 2
        reports.append(compare(codec, before, after, loaded))
    if args.json:
        print(json.dumps([{**asdict(r), "sample": asdict(sample)} for r in reports], indent=1))
    else:
        caveats = [CAVEAT, RANDOM_CAVEAT] if sample.random_weights else [CAVEAT]
        print("\n".join([sample.text(), *(r.text() for r in reports), *caveats]))
    return 0


def _sample(args: argparse.Namespace, prompts: list[list[int]]) -> Sample:
    architecture, random_weights = describe_model(Path(args.model))
    lengths = sorted(len(p) for p in prompts)
    if args.prompt_file is not None:
        source = f"from {args.prompt_file}"
        span = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    else:
        source, span = f"random token ids, seed {args.seed}", f"{lengths[0]}"
    return Sample(
        model=str(args.model),
        architecture=architecture,
        random_weights=random_weights,
        dtype=args.dtype,
        prompts=len(prompts),
        prompt_tokens=span,
        source=source,
        max_tokens=args.max_tokens,
    )


def _answers(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[Answer]:
    """Greedy answers one prompt at a time, with the chosen tokens' log-probabilities;
    then the engine steps until kvoffload's stores are done."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    out: list[Answer] = []
    for prompt in prompts:
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = result.outputs[0]
        tokens = tuple(completion.token_ids)
        logprobs = tuple(
            float(step[t].logprob) if step and t in step else math.nan
            for t, step in zip(tokens, completion.logprobs or [], strict=False)
        )
        out.append(Answer(tokens, logprobs))
        _drain(llm)
    return out


def _drain(llm: Any) -> None:
    """Step the engine while kvoffload has work in flight (its stores), bounded."""
    core = llm.llm_engine.engine_core.engine_core
    for _ in range(1000):
        if not core.scheduler.has_requests():
            return
        llm.llm_engine.step()


def _external_hits(llm: Any) -> int:
    from vllm.v1.metrics.reader import Counter

    return int(
        sum(
            m.value
            for m in llm.get_metrics()
            if isinstance(m, Counter) and m.name == "vllm:external_prefix_cache_hits"
        )
    )
