"""Chunk codecs in the simulator: a tier's capacity counts encoded chunks, its lanes
move encoded (or, where the CPU codes, raw) bytes, and the CPU's coding time is
charged on the lane that moves the chunk. Exact counts and simulated seconds only."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from sim_helpers import CHUNK_BYTES, config

from kvoffload.codecs import CODECS, FP8_RUN
from kvoffload.core.errors import UsageError
from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind, StepPlan, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.simulate import codecs as sim_codecs
from kvoffload.simulate.chat import ChatTrace
from kvoffload.simulate.codecs import CodecModel, TierCodec
from kvoffload.simulate.command import main
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.replicas import ReplicaSetup, run_replicas
from kvoffload.simulate.report import format_report
from kvoffload.simulate.request import StepMeter
from kvoffload.simulate.runner import Simulation, run_simulation
from kvoffload.simulate.worker import SimClock, SimWorker
from kvoffload.workload.chat import ChatWorkload

HOST_BYTES = 100 * CHUNK_BYTES  # 100 raw chunks of 32 KiB (16,384 bf16 elements)
CHECK = 8  # the checksum in every codec frame's header (issue 41)
FP8_BF16 = CHECK + CHUNK_BYTES // 2 + 4 * (CHUNK_BYTES // 2 // FP8_RUN)  # 16,384 + 4 scales
FP8_FP32 = CHECK + CHUNK_BYTES // 4 + 4 * (CHUNK_BYTES // 4 // FP8_RUN)  # 8,192 + 2 scales
LOSSLESS_BF16 = -(-CHUNK_BYTES * 20 // 29) + 16  # ratio 1.45 rounded up, length, checksum


def chat(users: int = 12, concurrent: int = 6, rate: float = 20.0) -> ChatTrace:
    shape = ChatWorkload(users=users, turns=4, system_tokens=96, output_tokens=24)
    return ChatTrace(dataclasses.replace(shape, user_tokens=(8, 40)), concurrent, rate)


def test_the_simulators_codec_names_are_kvoffloads() -> None:
    assert (sim_codecs.NONE, sim_codecs.LOSSLESS, sim_codecs.FP8) == CODECS


# ------------------------------------------------------------------ capacity


@pytest.mark.parametrize(
    ("model", "keyed", "slots"),
    [
        (CodecModel(), LOSSLESS_BF16, 144),  # 3,276,800 // 22,615
        (CodecModel(ratio=2.0), CHUNK_BYTES // 2 + 16, 199),
        (CodecModel(kv_dtype_bytes=4), -(-CHUNK_BYTES * 100 // 118) + 16, 117),
    ],
)
def test_lossless_shrinks_chunks_only_in_a_tier_keyed_by_chunk(
    model: CodecModel, keyed: int, slots: int
) -> None:
    """As the engine keeps them (decision 0023): a slotted tier (host memory, disk)
    keeps a lossless chunk in a slot of the raw size and 64 bytes; Redis keeps the
    frame and its length."""
    settings = config(
        cpu_bytes=HOST_BYTES,
        tier_bytes={"disk": HOST_BYTES, "redis": HOST_BYTES},
        codecs=dict.fromkeys(("host", "disk", "redis"), "lossless"),
        codec=model,
    )
    sizes = {name: c.chunk_bytes for name, c in settings.tier_codecs.items()}
    assert sizes == {"host": CHUNK_BYTES + 64, "disk": CHUNK_BYTES + 64, "redis": keyed}
    assert settings.host_slots == 99  # 3,276,800 // 32,832
    assert settings.tier_slots == {"disk": 99, "redis": slots}


@pytest.mark.parametrize(
    ("codec", "model", "encoded", "slots"),
    [
        ("none", CodecModel(), CHUNK_BYTES, 100),
        ("fp8", CodecModel(), FP8_BF16, 199),  # 3,276,800 // 16,408
        ("fp8", CodecModel(kv_dtype_bytes=4), FP8_FP32, 399),  # // 8,208
    ],
)
def test_a_tier_holds_its_bytes_in_encoded_chunks(
    codec: str, model: CodecModel, encoded: int, slots: int
) -> None:
    assert (FP8_BF16, FP8_FP32) == (16408, 8208)
    settings = config(
        cpu_bytes=HOST_BYTES,
        tier_bytes={"disk": HOST_BYTES, "redis": HOST_BYTES},
        codecs=dict.fromkeys(("host", "disk", "redis"), codec),
        codec=model,
    )
    assert {c.chunk_bytes for c in settings.tier_codecs.values()} == {encoded}
    assert settings.host_slots == slots
    assert settings.tier_slots == {"disk": slots, "redis": slots}
    sim = Simulation(settings)
    assert sim.host is not None and sim.host.num_slots == slots
    assert [tier.directory.num_slots for tier in sim.lower] == [slots, slots]


def test_each_tier_counts_its_own_codec() -> None:
    settings = config(
        cpu_bytes=HOST_BYTES,
        tier_bytes={"disk": HOST_BYTES, "redis": HOST_BYTES},
        codecs={"host": "fp8", "redis": "lossless"},
        codec=CodecModel(ratio=2.0),
    )
    assert settings.codecs == {"host": "fp8", "disk": "none", "redis": "lossless"}
    assert settings.host_slots == 199
    assert settings.tier_slots == {"disk": 100, "redis": 199}  # // (16,384 + 16)


@pytest.mark.parametrize("shared", [True, False])
def test_replicas_host_memory_counts_encoded_chunks(shared: bool) -> None:
    settings = config(cpu_bytes=HOST_BYTES, codecs={"host": "fp8"})
    result = run_replicas(settings, ReplicaSetup(2, shared), list(chat().requests()))
    # shared: one tier of 100 raw chunks' bytes; private: two of 50 each
    slots = HOST_BYTES // FP8_BF16 if shared else 2 * (HOST_BYTES // 2 // FP8_BF16)
    assert result.host_capacity_chunks == slots
    assert result.host_chunk_bytes == FP8_BF16
    assert result.as_json()["replicas"]["host_capacity_bytes"] == slots * FP8_BF16


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--no-progress", "--json", "-"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_a_share_of_the_distinct_chunks_is_of_raw_bytes(
    tmp_trace: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        json.dumps({"t": i, "segments": [{"id": f"d{i}", "len": 32 * 4}], "output": 1})
        for i in range(10)
    ]
    common = ["--trace", tmp_trace(*lines), "--chunk-tokens", "32", "--block-size", "16"]
    common += ["--bytes-per-token", "1024", "--engine-tokens", "4096", "--cpu-bytes", "50%"]
    raw = run_json(capsys, *common)
    fp8 = run_json(capsys, *common, "--codec", "fp8")
    # 50% of 40 distinct chunks: 20 raw chunks' bytes, whatever the codec
    assert raw["settings"]["cpu_bytes"] == fp8["settings"]["cpu_bytes"] == 20 * CHUNK_BYTES
    assert raw["tiers"][0]["capacity_chunks"] == 20
    assert fp8["tiers"][0]["capacity_chunks"] == 20 * CHUNK_BYTES // FP8_BF16 == 39


# ------------------------------------------------------------------ refusals


def test_fp8_is_refused_for_8_bit_kv_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match=r"--host-codec fp8: the KV is already 8-bit"):
        config(codecs={"host": "fp8"}, codec=CodecModel(kv_dtype_bytes=1))
    small = ["--users", "2", "--turns", "1", "--kv-dtype-bytes", "1"]
    with pytest.raises(UsageError, match=r"^--codec fp8: the KV is already 8-bit"):
        main([*small, "--codec", "fp8"])
    with pytest.raises(UsageError, match=r"^--disk-codec fp8: the KV is already 8-bit"):
        main([*small, "--disk-codec", "fp8"])
    # every tier overridden: --codec fp8 applies nowhere
    overridden = [f"--{tier}-codec=lossless" for tier in ("host", "disk", "redis")]
    assert run_json(capsys, *small, "--codec", "fp8", *overridden, "--codec-ratio", "1.1")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"codecs": {"host": "lossless"}, "codec": CodecModel(kv_dtype_bytes=1)}, "no typical"),
        ({"codecs": {"host": "zip"}}, "--host-codec: unknown codec 'zip'"),
        ({"codecs": {"tape": "fp8"}}, "--tape-codec: no such tier"),
        ({"codec": CodecModel(ratio=1.5)}, "--codec-ratio: only the lossless codec"),
        ({"codec": CodecModel(encode_gbps=2.0)}, "--codec-encode-gbps: no tier has a codec"),
    ],
)
def test_codec_settings_that_do_not_apply_are_refused(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        config(**settings)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"kv_dtype_bytes": 3}, "--kv-dtype-bytes: must be one of 1, 2, 4"),
        ({"ratio": 0.0}, "--codec-ratio: must be a number > 0"),
        ({"decode_gbps": float("nan")}, "--codec-decode-gbps: must be a number > 0"),
        ({"fp8_device": "tpu"}, "--fp8-device: must be one of gpu, cpu"),
    ],
)
def test_bad_codec_values_are_refused(model: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        CodecModel(**model)


# ------------------------------------------------------------------ lanes

GB = 10**9
COST = CostModel(host_gbps=10.0, tier_gbps={"disk": 2.0, "redis": 1.0})
# 1 GB chunks: coding at 1 GB/s encode and 2 GB/s decode, on the CPU
LOSSLESS_2X = TierCodec("lossless", GB, GB // 2, 1e-9, 5e-10)
FP8_GPU = TierCodec("fp8", GB, GB // 2, 1e-9, 5e-10, gpu=True)
FP8_CPU = dataclasses.replace(FP8_GPU, gpu=False)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def engine_job(job_id: int, kind: JobKind, n: int, tier: str | None = None) -> EngineJob:
    keys = tuple(key(i) for i in range(n))
    if tier is None:
        return EngineJob(job_id, kind, "r", keys, tuple(range(n)), tuple(range(n)), 1)
    slots = (NO_SLOT,) * n
    return EngineJob(
        job_id, kind, "r", keys, slots, tuple(range(n)), 1, tier=tier, tier_slots=tuple(range(n))
    )


def run_job(codecs: dict[str, TierCodec], job: EngineJob | TierJob) -> SimWorker:
    w = SimWorker(COST, GB, SimClock(), StepMeter(), codecs=codecs)
    w.begin(StepPlan(1))
    w.submit(job)
    return w


def finished(w: SimWorker, job_id: int) -> tuple[float, int, float]:
    """(finish time, bytes, seconds) of ``job_id``, reported once it finished."""
    at = w.finish_of[job_id]
    w.clock.step_end = at
    (result,) = w.poll()[0].results
    assert result.job_id == job_id and result.success
    return at, result.nbytes, result.seconds


@pytest.mark.parametrize(
    ("host", "store_s", "load_s", "link_bytes"),
    [
        (TierCodec.raw(GB), 0.1, 0.1, GB),  # no codec: the copy alone
        (LOSSLESS_2X, 0.1 + 1.0, 0.1 + 0.5, GB),  # raw over the link, CPU coding
        (FP8_CPU, 0.1 + 1.0, 0.1 + 0.5, GB),
        (FP8_GPU, 0.05, 0.05, GB // 2),  # the GPU codes: fp8 over the link, no CPU time
    ],
)
def test_stores_encode_and_loads_decode_on_host_memorys_lanes(
    host: TierCodec, store_s: float, load_s: float, link_bytes: int
) -> None:
    for kind, lane, seconds, coding in (
        (JobKind.STORE, "engine->host", store_s, host.encode_seconds(2)),
        (JobKind.LOAD, "host->engine", load_s, host.decode_seconds(2)),
    ):
        w = run_job({"host": host}, engine_job(1, kind, 2))
        assert w.traffic.busy_s == pytest.approx({lane: 2 * seconds})
        assert w.traffic.codec_s == (
            {lane: pytest.approx(coding)} if not host.gpu and coding else {}
        )
        assert finished(w, 1) == (
            pytest.approx(2 * seconds),
            2 * link_bytes,
            pytest.approx(2 * seconds),
        )


@pytest.mark.parametrize(
    ("host", "disk", "spill_s", "promote_s"),
    [
        (FP8_GPU, FP8_GPU, 0.25, 0.25),  # one codec: the encoded bytes move as they are
        (FP8_GPU, TierCodec.raw(GB), 0.5 + 0.5, 0.5 + 1.0),  # fp8 decoded, or encoded
        (TierCodec.raw(GB), LOSSLESS_2X, 0.25 + 1.0, 0.25 + 0.5),
    ],
)
def test_spills_and_promotions_recode_between_tiers_of_different_codecs(
    host: TierCodec, disk: TierCodec, spill_s: float, promote_s: float
) -> None:
    for kind, seconds in ((JobKind.SPILL, spill_s), (JobKind.PROMOTE, promote_s)):
        request = "r" if kind is JobKind.PROMOTE else None  # a spill serves no request
        job = TierJob(1, kind, (key(0),), (0,), "disk", (0,), request)
        w = run_job({"host": host, "disk": disk}, job)
        assert w.traffic.busy_s == pytest.approx({"disk": seconds})
        assert finished(w, 1) == (
            pytest.approx(seconds),
            disk.chunk_bytes,
            pytest.approx(seconds),
        )


@pytest.mark.parametrize(
    ("disk", "read_s", "staging_s"),
    [
        (LOSSLESS_2X, 0.25, 0.1 + 0.5),  # read encoded; decoded, then copied raw
        (FP8_GPU, 0.25, 0.05),  # copied as fp8, decoded on the GPU
    ],
)
def test_a_tier_load_reads_encoded_and_decodes_on_its_staging_lane(
    disk: TierCodec, read_s: float, staging_s: float
) -> None:
    w = run_job({"disk": disk}, engine_job(1, JobKind.LOAD, 1, tier="disk"))
    assert w.traffic.busy_s == pytest.approx({"disk": read_s, "disk->engine": staging_s})
    assert finished(w, 1) == (
        pytest.approx(read_s + staging_s),
        disk.chunk_bytes,
        pytest.approx(read_s + staging_s),
    )


# ------------------------------------------------------------------ whole runs


@pytest.mark.parametrize(
    ("codec", "model", "encoded"),
    [
        ("lossless", CodecModel(ratio=2.0), CHUNK_BYTES + 64),  # slotted: raw-size slots
        ("fp8", CodecModel(), FP8_BF16),
        ("none", CodecModel(), CHUNK_BYTES),
    ],
)
def test_a_tiers_bytes_written_and_read_are_its_encoded_chunks(
    codec: str, model: CodecModel, encoded: int
) -> None:
    settings = config(
        engine_tokens=1024,
        cpu_bytes=8 * CHUNK_BYTES,
        tier_bytes={"disk": 1000 * CHUNK_BYTES},
        lower_tier_loads="promote",
        codecs={"host": codec, "disk": codec},
        codec=model,
    )
    result = run_simulation(settings, chat(users=24).requests())
    tiers = result.as_json()["tiers"]
    assert [t["tier"] for t in tiers] == ["host", "disk"]
    for t, tier in zip(tiers, result.tiers, strict=True):
        assert tier.written > 0 and tier.read > 0
        assert (t["codec"], t["chunk_bytes"]) == (codec, encoded)
        assert t["codec_ratio"] == pytest.approx(CHUNK_BYTES / encoded)
        for key, chunks in (
            ("written", tier.written),
            ("read", tier.read),
            ("capacity", tier.capacity_chunks),
        ):
            assert t[f"{key}_bytes"] == chunks * encoded
            assert t[f"{key}_raw_bytes"] == chunks * CHUNK_BYTES


def test_coding_time_shows_on_the_lanes_of_a_lane_limited_run() -> None:
    requests = list(chat().requests())
    slow = CodecModel(ratio=2.0, encode_gbps=0.001, decode_gbps=0.002)
    base = run_simulation(config(engine_tokens=1024), requests)
    coded = run_simulation(
        config(engine_tokens=1024, codecs={"host": "lossless"}, codec=slow), requests
    )
    host = coded.tier("host")
    assert host is not None and host.written > 0 and host.read > 0
    encode_s = host.written * CHUNK_BYTES / 1e6  # raw bytes at 0.001 GB/s
    decode_s = host.read * CHUNK_BYTES / 2e6
    assert coded.lane_codec_s == pytest.approx({"engine->host": encode_s, "host->engine": decode_s})
    copy = coded.cost.copy_seconds  # lossless is CPU-coded: raw bytes over the link
    assert coded.lane_busy_s == pytest.approx(
        {
            "engine->host": encode_s + copy(host.written * CHUNK_BYTES, "host"),
            "host->engine": decode_s + copy(host.read * CHUNK_BYTES, "host"),
        }
    )
    assert coded.load_s == pytest.approx(copy(host.read * CHUNK_BYTES, "host") + decode_s)
    assert base.lane_codec_s == {}
    assert coded.simulated_s > base.simulated_s and coded.ttft_mean_s > base.ttft_mean_s
    assert "lanes' time encoding and decoding: engine->host" in format_report(coded)


def test_per_tier_codecs_override_codec_in_the_json_and_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--users", "6", "--turns", "2", "--engine-tokens", "4096", "--cpu-bytes", "64MiB"]
    argv += ["--disk-bytes", "1GiB", "--codec", "fp8", "--disk-codec", "lossless"]
    data = run_json(capsys, *argv)
    s = data["settings"]
    assert (s["host_codec"], s["disk_codec"], s["redis_codec"]) == ("fp8", "lossless", "fp8")
    assert (s["kv_dtype_bytes"], s["fp8_device"], s["codec_ratio"]) == (2, "gpu", None)
    assert [(t["tier"], t["codec"]) for t in data["tiers"]] == [
        ("host", "fp8"),
        ("disk", "lossless"),
    ]
    raw = data["chunk_bytes"]
    assert [t["chunk_bytes"] for t in data["tiers"]] == [
        CHECK + raw // 2 + 4 * (raw // 2 // FP8_RUN),
        raw + 64,  # a disk slot of the raw size (decision 0023)
    ]
    for key in ("written", "read", "capacity"):
        assert all(f"{key}_bytes" in t and f"{key}_raw_bytes" in t for t in data["tiers"])
    assert "lane_codec_s" in data
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "  codecs       host fp8 (" in out and ", disk lossless (" in out
    assert "bytes as the tiers hold them (encoded)" in out


def test_without_a_codec_the_report_has_no_codec_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--users", "6", "--turns", "2", "--cpu-bytes", "64MiB", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "codecs" not in out and "encoded" not in out
