"""``vllm serve`` with kvoffload, end to end over HTTP.

One server for the module: the tiny random Llama (copied, plus a tokenizer from
``write_tokenizer``), kvoffload named only by ``kv_connector`` (the
``vllm.general_plugins`` entry point registers the name), an engine KV cache of 40
blocks, so a 25-block prompt is partly evicted by the next one and must come back
from kvoffload. Requests go through the ``openai`` client; ``/metrics`` is scraped
for kvoffload's series. Bad configurations start their own servers, which must exit
before the model loads. Wall times are printed (``pytest -s``), never asserted.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.testing.vllm_server import (
    VllmServer,
    special_token_ids,
    token_text,
    vllm_executable,
    write_tokenizer,
)

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

BLOCK_BYTES = 32 * 1024  # the tiny model: 2 layers x K,V x 2 heads x 32 dims x 4 B x 32 tokens
KV_CACHE_BYTES = 40 * BLOCK_BYTES  # 40 engine blocks; max-model-len 1024 needs 32
VOCAB = 1024
MAX_TOKENS = 8
# What vLLM logs when it starts loading weights (read from a good server's log:
# "Starting to load model ...", then the safetensors progress bar and
# "Loading weights took ...").
MODEL_LOADING_MARKERS = ("Starting to load model", "Loading safetensors", "Loading weights")
CONFIG_ERROR = "kvoffload: invalid kv_connector_extra_config:"


def transfer_config(extra: dict[str, Any]) -> str:
    return json.dumps(
        {
            "kv_connector": "KVOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def prompt(first_id: int, length: int) -> str:
    """``length`` distinct word tokens starting at ``first_id`` (ids past the specials
    0-3: the tiny model's pad, bos, eos, and unk)."""
    return " ".join(token_text(4 + (first_id + i) % (VOCAB - 4)) for i in range(length))


@pytest.fixture(scope="module")
def served_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model with a tokenizer (the session's copy stays as it is)."""
    model = tmp_path_factory.mktemp("served") / "tiny"
    shutil.copytree(tiny_model, model)
    write_tokenizer(model, VOCAB)
    assert set(special_token_ids(model, VOCAB).values()) == {0, 1, 2, 3}
    return model


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_serve_command() -> tuple[dict[str, str], list[str]]:
    """The environment and the ``vllm serve`` arguments (after the model) of the
    README's "Use with vLLM" command, as a shell would split them."""
    text = README.read_text()
    section = text[text.index("## Use with vLLM") :]
    start = section.index("```bash") + len("```bash")
    block = section[start : section.index("```", start)]
    lines = block.splitlines()
    (first,) = [i for i, ln in enumerate(lines) if " vllm serve " in f" {ln} "]
    words = shlex.split("\n".join(lines[first:]).replace("\\\n", " "), comments=True)
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:2] == ["vllm", "serve"], words
    return env, words[3:]  # after the model


@pytest.fixture(scope="module")
def server(served_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The README's command, with the tiny model, its engine KV cache size, and a
    host and disk tier sized for it (the README's sizes are a real machine's)."""
    env, args = readme_serve_command()
    args[args.index("--kv-cache-memory-bytes") + 1] = str(KV_CACHE_BYTES)
    at = args.index("--kv-transfer-config") + 1
    transfer = json.loads(args[at])
    assert transfer == json.loads(transfer_config(transfer["kv_connector_extra_config"]))
    extra = transfer["kv_connector_extra_config"]
    extra.update(cpu_bytes=64_000_000, disk_bytes=64_000_000)
    extra["disk_path"] = str(tmp_path_factory.mktemp("disk"))
    args[at] = json.dumps(transfer)
    log = tmp_path_factory.mktemp("serve-logs") / "kvoffload.log"
    started = time.monotonic()
    with VllmServer(
        served_model,
        log,
        [*args, "--enable-prompt-tokens-details"],
        kv_cache_bytes=KV_CACHE_BYTES,
        cores=env.pop("VLLM_CPU_OMP_THREADS_BIND", "0"),
        env=env,
    ) as srv:
        print(f"\nvllm serve with kvoffload ready in {time.monotonic() - started:.1f} s")
        yield srv


@pytest.fixture
def client(server: VllmServer) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def metrics(server: VllmServer) -> dict[str, float]:
    """``kvoffload_*`` samples of ``/metrics`` keyed ``name{label=value,...}`` (vLLM's
    ``engine`` and ``model_name`` labels left out), summed over what is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics")):
        for sample in family.samples:
            if not sample.name.startswith("kvoffload_"):
                continue
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(sample.labels.items())
                if k not in ("engine", "model_name")
            )
            key = f"{sample.name}{{{labels}}}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


STORED = "kvoffload_transferred_chunks_total{direction=store,tier=host}"
LOADED = "kvoffload_transferred_chunks_total{direction=load,tier=host}"
HIT_TOKENS = "kvoffload_hit_tokens_total{tier=host}"


def eventually(server: VllmServer, check: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """Scrape until ``check`` holds (stats reach the API server a step after the work
    they count); returns the last scrape, for the caller's asserts."""
    deadline = time.monotonic() + 10
    while True:
        samples = metrics(server)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)  # waiting for the engine process to publish its stats


def complete(client: Any, model: str, text: str) -> Any:
    return client.completions.create(model=model, prompt=text, temperature=0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize(
    ("extra", "bad_key"),
    [
        ({"cpu_bytes": -1}, "cpu_bytes"),
        ({"cpu_bytes": 64_000_000, "cpu_byte": 1}, "cpu_byte"),
    ],
    ids=["negative-cpu-bytes", "unknown-key"],
)
def test_bad_config_exits_before_the_model_loads(
    served_model: Path, tmp_path: Path, extra: dict[str, Any], bad_key: str
) -> None:
    srv = VllmServer(
        served_model,
        tmp_path / "bad.log",
        ["--kv-transfer-config", transfer_config(extra)],
        kv_cache_bytes=KV_CACHE_BYTES,
    )
    srv.launch()
    try:
        status = srv.wait_exit(timeout_s=300)
    finally:
        srv.stop()
    print(f"\nbad config {extra}: exit status {status} after {srv.elapsed_s():.1f} s")
    log = srv.log_text()
    lines = log.splitlines()

    assert status != 0
    errors = [line for line in lines if CONFIG_ERROR in line]
    assert len(errors) == 1, f"expected one config error line, got {errors}\n{log}"
    assert f"kvoffload config '{bad_key}':" in errors[0]
    assert len([line for line in lines if f"config '{bad_key}'" in line]) == 1, log
    loading = [line for line in lines if any(m in line for m in MODEL_LOADING_MARKERS)]
    assert not loading, f"the model started loading: {loading}"
    assert "Traceback" not in log


def test_vllm_version_is_the_cpu_build() -> None:
    done = subprocess.run(
        [str(vllm_executable()), "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    version = done.stdout.strip().splitlines()[-1]
    assert version.endswith("+cpu"), done.stdout


def test_repeated_prefix_served_by_kvoffload_gives_the_same_text(
    server: VllmServer, client: Any
) -> None:
    """A 780-token prompt (a 768-token shared prefix + 12), then another 800-token prompt
    that evicts part of it from the 40-block engine cache, then the first again: the
    same text, most of the prompt cached, and kvoffload loaded chunks back."""
    shared = prompt(0, 768)
    text = shared + " " + prompt(900, 12)
    before = metrics(server)
    first = complete(client, server.model, text)
    complete(client, server.model, prompt(400, 800))
    again = complete(client, server.model, text)

    assert first.usage.prompt_tokens == 780
    assert first.usage.completion_tokens == MAX_TOKENS
    assert first.choices[0].text.split(), "no text generated"
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 768
    after = eventually(server, lambda m: m.get(LOADED, 0) > before.get(LOADED, 0))
    assert after.get(LOADED, 0) > before.get(LOADED, 0), "kvoffload loaded nothing back"
    assert after.get(HIT_TOKENS, 0) > before.get(HIT_TOKENS, 0)


def test_chat_completions_plain_and_streamed_agree(server: VllmServer, client: Any) -> None:
    messages = [{"role": "user", "content": prompt(100, 200)}]
    plain = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    stream = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]

    content = plain.choices[0].message.content
    assert content and content.split()
    assert plain.usage.completion_tokens == MAX_TOKENS
    assert plain.choices[0].finish_reason == "length"
    assert len([p for p in pieces if p]) >= 2, "the answer was not streamed in pieces"
    assert "".join(pieces) == content


def test_metrics_carry_kvoffload_series_and_stored_chunks(server: VllmServer, client: Any) -> None:
    complete(client, server.model, prompt(200, 300))  # 9 full chunks to store
    samples = eventually(server, lambda m: m.get(STORED, 0) > 0)

    names = {key.split("{", 1)[0] for key in samples}
    for name in (
        "kvoffload_lookups_total",
        "kvoffload_transferred_chunks_total",
        "kvoffload_capacity_bytes",
        "kvoffload_usage_bytes",
    ):
        assert name in names, f"{name} missing from /metrics; kvoffload series: {sorted(names)}"
    assert samples[STORED] > 0
    assert samples["kvoffload_capacity_bytes{tier=host}"] > 0


PARAM_ERRORS = "kvoffload_request_param_errors_total{field=kvoffload.store}"
IN_FLIGHT = "kvoffload_jobs_in_flight{}"


def settled(server: VllmServer) -> dict[str, float]:
    """A scrape taken once kvoffload has no job in flight (earlier requests' final
    stores included)."""
    samples = eventually(server, lambda m: m.get(IN_FLIGHT, 1) == 0)
    assert samples.get(IN_FLIGHT, 1) == 0, samples
    return samples


def test_per_request_controls_in_the_request_body(server: VllmServer, client: Any) -> None:
    """``kv_transfer_params`` in the OpenAI request body: a private request stores
    nothing; a bad value is served, warned about once and counted."""
    before = settled(server)
    private = client.completions.create(
        model=server.model,
        prompt=prompt(500, 300),
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"kv_transfer_params": {"kvoffload": {"store": False}}},
    )
    assert private.usage.completion_tokens == MAX_TOKENS
    after = settled(server)
    assert after.get(STORED, 0) == before.get(STORED, 0), "a private request was stored"
    bad = client.completions.create(
        model=server.model,
        prompt=prompt(600, 100),
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"kv_transfer_params": {"kvoffload": {"store": "no"}}},
    )
    assert bad.usage.completion_tokens == MAX_TOKENS
    counted = eventually(server, lambda m: m.get(PARAM_ERRORS, 0) == 1)
    assert counted.get(PARAM_ERRORS, 0) == 1
    warnings = [
        line
        for line in server.log_text().splitlines()
        if "invalid kv_transfer_params field 'kvoffload.store'" in line
    ]
    assert len(warnings) == 1, warnings
