"""Settings for tests against a real vLLM (the tiny model fixture is in tests/conftest.py)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
