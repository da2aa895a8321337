"""An engine on a vLLM release kvoffload is not tested with is refused at start (the
connector's constructor), unless the override is set."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.adapters.vllm.versions import OVERRIDE
from kvoffload.core.errors import ConfigError


def test_an_untested_vllm_is_refused_unless_overridden(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv(OVERRIDE, raising=False)
    with pytest.raises(ConfigError, match=r"vLLM 0\.35\.0 .*0\.32, 0\.33"):
        make()
    monkeypatch.setenv(OVERRIDE, "1")
    h = make()
    assert h.side is not None  # the connector started on the untested release
