"""Shared pytest configuration: hypothesis profiles (CI is the default), the tiny
random Llama written once per session, a private redis-server per test, the
session's own cache of weight-file digests, and the check that no test left a
redis-server running."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvoffload.testing.redis_server import RedisServer, stop_leftovers

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A directory every user may write, sticky (mode 1777), as /dev/shm and /tmp
    are: where another local user (``tests/share/other_user.py``) may squat names."""
    root = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def digest_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The content digests of weight files (``core/identity/content_digest.py``) are
    remembered in a directory of the session's, not the user's cache (engines in
    child processes inherit it)."""
    root = tmp_path_factory.mktemp("digest-cache")
    saved = os.environ.get("KVOFFLOAD_CACHE_DIR")
    os.environ["KVOFFLOAD_CACHE_DIR"] = str(root)
    yield root
    if saved is None:
        os.environ.pop("KVOFFLOAD_CACHE_DIR", None)
    else:
        os.environ["KVOFFLOAD_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset of ``kvoffload.demos.tiny_model`` (2 layers, float32)."""
    from kvoffload.demos.tiny_model import ensure_model

    return ensure_model("tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_longrope_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny-longrope`` preset: the tiny shape as a Phi-3-style model whose
    LongRoPE factors vLLM picks from ``max_model_len`` (short up to 256)."""
    from kvoffload.demos.tiny_model import ensure_model

    return ensure_model("tiny-longrope", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny-swa`` preset: the tiny shape as a Mistral-style model whose every
    layer attends through a 64-token sliding window."""
    from kvoffload.demos.tiny_model import ensure_model

    return ensure_model("tiny-swa", tmp_path_factory.mktemp("models"))


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session", autouse=True)
def no_redis_server_left_running() -> Iterator[None]:
    """At the end of the session every redis-server a test started is stopped; any
    still running is stopped here by its pid and fails the session."""
    yield
    left = stop_leftovers()
    if left:
        pytest.fail(f"redis-server left running by the tests (now killed): {'; '.join(left)}")
