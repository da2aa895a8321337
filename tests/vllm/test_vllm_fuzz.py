"""The vLLM fuzzer in CI: 200 seeds, each on vLLM's Scheduler and AsyncScheduler
(``python -m kvoffload.testing.vllm_fuzz --seeds 200`` runs the same), and proof
that its checks catch what they claim to: bugs planted on purpose are found,
reported with their seed and shrunk. About a third of the seeds run several KV cache
groups (full attention and sliding windows), none of them refused any more."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.codecs.chunk_codec import Fp8Chunks, LosslessChunks
from kvoffload.core.keys import ChunkKey
from kvoffload.core.kv_groups import KVGroups
from kvoffload.core.scheduler import stores
from kvoffload.share.client import ShareDirectory
from kvoffload.testing.vllm_fuzz.__main__ import main, report
from kvoffload.testing.vllm_fuzz.codecs import codec_options, draw_codecs
from kvoffload.testing.vllm_fuzz.groups import draw_groups
from kvoffload.testing.vllm_fuzz.runner import Environment, Outcome, harness_spec, run_scenario
from kvoffload.testing.vllm_fuzz.scenario import Tiers, random_scenario
from kvoffload.testing.vllm_fuzz.shared_host import draws_shared_host, run_shared, shared_scenario
from kvoffload.testing.vllm_fuzz.shrink import shrink

CI_SEEDS = 200


@pytest.fixture(scope="module")
def env(tiny_model: Path) -> Iterator[Environment]:
    environment = Environment(tiny_model)
    try:
        yield environment
    finally:
        environment.close()


def first_failure(env: Environment, seeds: Iterable[int]) -> Outcome | None:
    for seed in seeds:
        for is_async in (False, True):
            outcome = run_scenario(random_scenario(seed, is_async), env)
            if outcome.failed:
                return outcome
    return None


def test_two_hundred_seeds_on_both_schedulers_break_nothing(env: Environment) -> None:
    failure = first_failure(env, range(CI_SEEDS))
    if failure is not None:
        shrunk, runs = shrink(failure, env)
        pytest.fail(report(failure, shrunk, runs))


def test_seeds_draw_windows_alone_with_full_attention_and_of_different_sizes() -> None:
    draws = [draw_groups(seed) for seed in range(CI_SEEDS)]
    windowed = [g for g in draws if any(w is not None for w in g)]
    assert sum(g == (None,) for g in draws) > CI_SEEDS // 2
    assert any(None in g and len(g) >= 3 for g in windowed)  # full + several windows
    assert any(None not in g for g in windowed)  # windows only
    assert any(len({w for w in g if w is not None}) > 1 for g in windowed)
    assert random_scenario(20001, True).groups == (None,)  # a one-group seed kept its draws


def test_the_command_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "2", "--start", "1000", "-q"]) == 0
    out = capsys.readouterr().out
    shared = sum(draws_shared_host(seed) for seed in (1000, 1001))  # the shape drawn besides
    assert shared == 1
    assert "6 schedules (3 sync, 3 async) from seeds 1000..1001" in out and "0 failed" in out
    assert "shared_host_schedules 2" in out


def test_a_schedule_that_does_not_end_is_reported_as_a_hang() -> None:
    """A schedule outliving ``--schedule-timeout`` is a hang: its seed, a rerun line and
    every thread's stack, exit status 3 (here: a timeout no schedule can meet)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.testing.vllm_fuzz", "--seeds", "1", "--start", "7",
         "--scheduler", "sync", "--schedule-timeout", "0.01", "-q"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "HUNG seed 7 (sync scheduler)" in done.stdout
    assert "--start 7 --scheduler sync" in done.stdout and "Thread 0x" in done.stdout


def test_a_store_reading_the_wrong_blocks_is_found_and_shrunk(
    env: Environment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: every store job reads its blocks in the wrong order (chunk i from
    the blocks of chunk i+1)."""
    real = stores.plan_store_job

    def shifted(*args, **kwargs):  # type: ignore[no-untyped-def]
        job = real(*args, **kwargs)
        if job is None or len(job.block_ids) < 2:
            return job
        from dataclasses import replace

        return replace(job, block_ids=job.block_ids[1:] + job.block_ids[:1])

    monkeypatch.setattr(stores, "plan_store_job", shifted)
    failure = first_failure(env, range(40))
    assert failure is not None and "does not hold its own KV" in failure.message
    shrunk, _ = shrink(failure, env, budget=60)
    assert shrunk.failed and len(shrunk.scenario.requests) <= len(failure.scenario.requests)
    assert f"seed {failure.scenario.seed}" in report(failure, shrunk, 1)


def test_a_missing_flush_fence_is_found(env: Environment, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: no store is flushed when its source block is handed out again."""
    monkeypatch.setattr(stores, "fenced_stores", lambda *args: set())
    failure = first_failure(env, range(60))
    assert failure is not None
    assert "still reads blocks" in failure.message or "does not hold its own KV" in failure.message


def test_a_chunk_of_one_group_loaded_into_another_is_found(
    env: Environment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: every KV cache group's chunk is stored under the chain key, so groups
    overwrite and load each other's chunks."""

    def chain_key(self: KVGroups, key: ChunkKey, group: int) -> ChunkKey:
        return key

    monkeypatch.setattr(KVGroups, "key", chain_key)
    seeds = [s for s in range(CI_SEEDS) if len(draw_groups(s)) > 1]
    failure = first_failure(env, seeds[:20])
    assert failure is not None and "does not hold its own KV" in failure.message
    assert len(failure.scenario.groups) > 1


SHARED_SEEDS = 6


def test_the_shared_host_shape_shares_kills_and_recovers(tiny_model: Path) -> None:
    """Several engines over one node-shared host tier, engines and the node process
    killed, the share stopped (a remove refused) and its directory deleted under
    them: nothing breaks, and what the shape claims happened (cross-engine loads,
    kills, restarts, recoveries from a new node process, workers moved to new slab
    files), and, with vLLM's KV events on, every engine's announcements of what the
    shares hold checked after every step while they held chunks."""
    totals: Counter[str] = Counter()
    for seed in range(SHARED_SEEDS):
        for is_async in (False, True):
            outcome = run_shared(shared_scenario(seed, is_async), tiny_model)
            assert not outcome.failed, outcome.report()
            totals.update(outcome.stats)
    assert totals["shared_host_schedules"] == 2 * SHARED_SEEDS
    assert totals["cross_engine_loads"] > 0
    assert totals["shared_loads_checked"] >= totals["cross_engine_loads"]
    assert totals["engine_kills"] > 0 and totals["engine_restarts"] > 0
    assert totals["node_kills"] > 0 and totals["recoveries"] > 0
    assert totals["share_stops"] > 0 and totals["share_wipes"] > 0 and totals["slab_remaps"] > 0
    assert totals["shared_requests_checked"] > 0
    assert totals["shared_announcement_checks"] > 0


def test_a_shared_host_seed_runs_the_same_twice(tiny_model: Path) -> None:
    scenario = shared_scenario(3, False)  # a node-process kill, engines stored meanwhile
    assert scenario.node_kills
    first, second = (run_shared(scenario, tiny_model) for _ in range(2))
    assert not first.failed, first.report()
    assert first.stats == second.stats


def test_the_shared_host_shape_is_drawn_for_some_seeds_and_can_be_forced() -> None:
    drawn = sum(draws_shared_host(seed) for seed in range(CI_SEEDS))
    assert CI_SEEDS // 20 < drawn < CI_SEEDS // 4
    assert main(["--shape", "shared-host", "--seeds", "1", "--start", "4", "-q"]) == 0


def test_a_killed_engine_whose_stores_are_published_is_found(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted bug: closing a share's client completes the stores it booked (as if
    a killed engine's half-copied chunks were published), at the host share or at a
    shared disk tier's."""
    close = ShareDirectory.close

    def publishing_close(self: ShareDirectory) -> None:
        storing = list(self.attachment.bookings.current.storing)
        if storing:
            self.complete_store(storing, True)
        close(self)

    monkeypatch.setattr(ShareDirectory, "close", publishing_close)
    failure = next(
        outcome
        for seed in range(20)
        for is_async in (False, True)
        if (outcome := run_shared(shared_scenario(seed, is_async), tiny_model)).failed
    )
    # found at the host share, or at the disk share of a seed that draws one (its
    # client's close publishes the spills too)
    found = (
        "a killed engine was storing are readable",
        "a killed engine was spilling are readable",
    )
    assert any(text in failure.message for text in found), failure.message


def codec_seeds(codecs: set[str], count: int) -> list[int]:
    """The first ``count`` seeds whose engine runs one of ``codecs`` in some tier."""
    found = []
    for seed in range(2000):
        scenario = random_scenario(seed, True)
        tier = {Tiers.DISK: "disk", Tiers.REDIS: "redis"}.get(scenario.tiers)
        if codecs & set(codec_options(scenario.codecs, tier).values()):
            found.append(seed)
        if len(found) == count:
            break
    return found


def test_codec_seeds_load_their_chunks_back_through_the_codecs(env: Environment) -> None:
    """A share of the seeds draw codecs (host memory's and the lower tier's, equal or
    not); their loads pass the harness's KV checks: exact for lossless, within e4m3's
    bound for fp8 (the CI seeds above include them; this asserts they really ran)."""
    draws = [draw_codecs(s) for s in range(CI_SEEDS)]
    assert 40 <= sum(d != ("none", "none") for d in draws) <= 100
    assert any(d[0] != d[1] for d in draws) and any(d[0] == d[1] != "none" for d in draws)
    checked = {"fp8": 0, "lossless": 0}
    for codec in checked:
        for seed in codec_seeds({codec}, 6):
            scenario = random_scenario(seed, True)
            spec = harness_spec(scenario, env, env.root)
            drawn = [spec.extra.get(k) for k in ("codec", "disk_codec", "redis_codec")]
            assert codec in drawn  # the engine really runs the codec
            outcome = run_scenario(scenario, env)
            assert not outcome.failed, outcome.message
            checked[codec] += outcome.stats["loads_checked"]
    assert checked["fp8"] > 0 and checked["lossless"] > 0


@pytest.mark.parametrize("codec", ["fp8", "lossless"])
def test_a_codec_that_returns_wrong_values_is_found(
    env: Environment, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """Planted: decoding puts back every value off by more than fp8's bound (fp8:
    a quarter more; lossless: one more), so the checks, exact or within the bound,
    fail."""
    cls = Fp8Chunks if codec == "fp8" else LosslessChunks
    real = cls.decode

    def wrong(self: Any, stored: torch.Tensor, out: torch.Tensor) -> None:
        real(self, stored, out)
        values = out.view(torch.float32)
        values.copy_(values * 1.25 if codec == "fp8" else values + 1)

    monkeypatch.setattr(cls, "decode", wrong)
    failure = first_failure(env, codec_seeds({codec}, 20))
    assert failure is not None and "does not hold its own KV" in failure.message
    assert codec in failure.scenario.codecs


def sealed_forged_seeds(count: int) -> list[int]:
    """Seeds whose lower tier is sealed and whose store forges chunks."""
    from kvoffload.testing.vllm_fuzz.scenario import FaultKind

    found = []
    for seed in range(10_000):
        scenario = random_scenario(seed, False)
        if scenario.sealed and scenario.fault(FaultKind.FORGED) is not None:
            found.append(seed)
        if len(found) == count:
            return found
    raise AssertionError("too few sealed seeds")


def test_sealed_seeds_seal_their_tier_and_forged_chunks_are_refused(env: Environment) -> None:
    """A share of the seeds with a lower tier seal it, most with forged writes; the CI
    seeds include them (this asserts they really ran sealed, and that forged chunks
    were read back and refused, never loaded)."""
    seeds = sealed_forged_seeds(40)
    assert sum(random_scenario(s, False).sealed for s in range(CI_SEEDS)) >= 15
    refused = 0
    for seed in seeds:
        scenario = random_scenario(seed, True)
        spec = harness_spec(scenario, env, env.root)
        assert spec.extra["seal_key_file"]  # the engine really seals
        outcome = run_scenario(scenario, env)
        assert not outcome.failed, outcome.message
        refused += outcome.stats["seal_integrity_errors"]
        if refused >= 3:
            break
    assert refused >= 3


def test_a_seal_that_accepts_any_tag_is_found(
    env: Environment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: opening decrypts (AES-CTR from GCM's first counter block) without
    checking the tag, so a forged chunk's bytes reach the engine; the harness's
    model finds KV it never computed."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from kvoffload.sealing.layout import PREFIX_BYTES, TAG_BYTES, decode_prefix
    from kvoffload.sealing.sealer import Sealer

    def accepts_anything(self: Sealer, sealed: memoryview, out: memoryview, context: Any) -> int:
        prefix = decode_prefix(sealed)
        key = self.keys.by_id(prefix.key_id)
        assert key is not None
        counter = prefix.nonce + (2).to_bytes(4, "big")  # GCM's first block for the data
        ctr = Cipher(algorithms.AES(key.secret), modes.CTR(counter)).decryptor()
        n = prefix.length
        out[:n] = ctr.update(bytes(sealed[PREFIX_BYTES : PREFIX_BYTES + n]))
        assert len(sealed) >= PREFIX_BYTES + n + TAG_BYTES
        return n

    monkeypatch.setattr(Sealer, "open_into", accepts_anything)
    failure = first_failure(env, sealed_forged_seeds(40))
    assert failure is not None and failure.scenario.sealed
    assert "does not hold its own KV" in failure.message or "produced" in failure.message
