"""The namespace covers everything that changes KV values (decision 0010): real vLLM
configs of the tiny Llama, the namespace as ``derive_geometry`` derives it on both
halves. No engine runs here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.adapters.vllm import identity
from kvoffload.adapters.vllm.geometry import derive_geometry
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.keys import Namespace
from kvoffload.testing.vllm_harness.spec import HarnessSpec, kv_cache_config

ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def namespace(model: Path, cache: dict[str, Any] | None = None, **model_args: Any) -> Namespace:
    """The namespace of the tiny Llama at ``model`` with ``model_args`` for vLLM's
    ``ModelConfig`` and ``cache`` for its ``CacheConfig`` (the KV layout is the
    harness's, the same for every call: only the model's identity varies)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    args = {"dtype": "float32", **model_args}
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), max_model_len=2048, skip_tokenizer_init=True, **args
        ),
        cache_config=CacheConfig(block_size=16, **(cache or {})),
    )
    config = OffloadConfig.from_dict({"cpu_bytes": 1 << 20})
    return derive_geometry(vllm_config, kv_cache_config(HarnessSpec()), config).namespace


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Namespace:
    return namespace(tiny_model)


def test_an_unchanged_configuration_derives_the_same_namespace(
    tiny_model: Path, base: Namespace
) -> None:
    again = namespace(tiny_model)
    assert again == base and again.digest() == base.digest()
    assert base.config and base.weights  # the adapter always fills both


def test_another_process_derives_the_same_namespace(tiny_model: Path, base: Namespace) -> None:
    """The halves may live in different processes (vLLM's engine core and its
    workers): the digest depends on no per-process state (hash seeds, addresses)."""
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_namespace_identity import namespace\n"
        "from pathlib import Path\n"
        "print(namespace(Path(sys.argv[2])).digest().hex())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "777"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(tiny_model)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == base.digest().hex()


@pytest.mark.parametrize(
    ("model_args", "cache"),
    [
        pytest.param({"hf_overrides": {"rms_norm_eps": 1.0}}, None, id="hf-override"),
        pytest.param({"hf_overrides": {"rope_parameters": ROPE}}, None, id="rope-scaling"),
        pytest.param({"dtype": "bfloat16"}, None, id="model-dtype"),
        pytest.param(
            {"dtype": "bfloat16", "quantization": "fp8_per_tensor"}, None, id="quantization"
        ),
        pytest.param({}, {"cache_dtype": "fp8"}, id="kv-cache-dtype"),
        pytest.param({"revision": "v2"}, None, id="revision"),
    ],
)
def test_a_change_that_reaches_the_forward_pass_makes_a_new_namespace(
    tiny_model: Path, base: Namespace, model_args: dict[str, Any], cache: dict[str, Any] | None
) -> None:
    changed = namespace(tiny_model, cache, **model_args)
    assert changed.digest() != base.digest()
    assert changed.layout == base.layout  # the same KV layout: only the identity differs


def test_quantization_differs_from_its_unquantized_dtype(tiny_model: Path) -> None:
    plain = namespace(tiny_model, dtype="bfloat16")
    quantized = namespace(tiny_model, dtype="bfloat16", quantization="fp8_per_tensor")
    assert quantized.config != plain.config and quantized.weights == plain.weights


def test_a_replaced_weight_file_makes_a_new_namespace(tiny_model: Path, tmp_path: Path) -> None:
    """Same directory, same file names and sizes, same safetensors header: only the
    tensor data differs (a fine-tune copied over the old weights)."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model, model)
    before = namespace(model)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end] ^= 0xFF
    weights.write_bytes(bytes(data))
    after = namespace(model)
    assert (after.model, after.config) == (before.model, before.config)
    assert after.weights != before.weights and after.digest() != before.digest()


def hub(revision: str, cache_dir: str | None = None) -> Any:
    model = SimpleNamespace(model="org/model", revision=revision, model_weights="")
    return SimpleNamespace(model_config=model, load_config=SimpleNamespace(download_dir=cache_dir))


def test_a_hub_revision_is_its_commit_in_the_local_cache(tmp_path: Path) -> None:
    commit_a, commit_b = "a" * 40, "b" * 40
    repo = tmp_path / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / commit_a).mkdir(parents=True)
    (repo / "snapshots" / commit_a / "config.json").write_text("{}")
    (repo / "refs" / "main").write_text(commit_a)
    cache = str(tmp_path)
    assert identity.resolved_revision("org/model", "main", cache) == commit_a
    assert identity.weights_digest(hub("main", cache)) == identity.weights_digest(hub(commit_a))
    (repo / "snapshots" / commit_b).mkdir()
    (repo / "snapshots" / commit_b / "config.json").write_text("{}")
    (repo / "refs" / "main").write_text(commit_b)  # main moved on: new weights
    assert identity.weights_digest(hub("main", cache)) == identity.weights_digest(hub(commit_b))
    assert identity.weights_digest(hub(commit_a)) != identity.weights_digest(hub(commit_b))


def test_an_unresolved_hub_revision_is_identified_by_its_name(tmp_path: Path) -> None:
    assert identity.resolved_revision("org/model", "v1", str(tmp_path)) == "v1"
    assert identity.weights_digest(hub("v1", str(tmp_path))) != identity.weights_digest(
        hub("v2", str(tmp_path))
    )


def test_an_odd_configuration_never_fails_the_start() -> None:
    """Missing sections and values without a JSON form still digest."""
    odd = SimpleNamespace(model_config=SimpleNamespace(hf_config=object(), dtype=None))
    assert identity.config_digest(odd) == identity.config_digest(odd)
    assert identity.weights_digest(SimpleNamespace()) == identity.weights_digest(None)


def test_each_worker_announces_its_namespace_and_a_mismatch_is_counted(
    tiny_model: Path,
) -> None:
    """Workers send the namespace they derived with their first report; the harness
    (real connectors) runs without an anomaly, so they agree. A worker that derived
    another one (its model load edited the configuration) is counted and named."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvoffload.adapters.vllm.messages import ReportMetadata
    from kvoffload.core.observe.anomalies import Anomaly
    from kvoffload.testing.vllm_harness import VllmHarness

    h = VllmHarness(tiny_model, world_size=2, expect_anomalies=True)
    try:
        seen: list[tuple[int, bytes]] = []
        check = h.side._check_namespaces
        h.side._check_namespaces = lambda announced: (seen.extend(announced), check(announced))  # type: ignore[method-assign]
        h.add_request("a", list(range(40)), 2)
        h.run()
        own = h.side.geometry.namespace.digest()
        assert sorted(seen) == [(0, own), (1, own)]  # each rank once, the same namespace
        assert h.scheduler_half.anomalies.counts == {}
        other = ReportMetadata((), ((1, b"\x07" * 16),))
        h.side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=other))
        assert h.scheduler_half.anomalies.counts == {Anomaly.NAMESPACE_MISMATCH: 1}
    finally:
        h.close()
