"""LoRA adapters identified by content in their requests' keys (decision 0019)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvoffload.adapters.vllm.lora_identity import AdapterDigests
from kvoffload.core.identity.content_digest import DigestCache


@dataclass
class Lora:
    lora_name: str
    lora_path: str


@dataclass
class Request:
    lora_request: Lora | None


def adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_a_request_without_an_adapter_adds_nothing(tmp_path: Path) -> None:
    assert AdapterDigests(DigestCache(tmp_path / "c")).extra(Request(None)) == b""


def test_an_adapter_rewritten_in_place_gets_another_identity(tmp_path: Path) -> None:
    digests = AdapterDigests(DigestCache(tmp_path / "c"))
    path = adapter(tmp_path / "a", b"\x01" * 4096)
    before = digests.extra(Request(Lora("a", str(path))))
    adapter(path, b"\x02" * 4096)  # same name, path and size
    after = digests.extra(Request(Lora("a", str(path))))
    assert before and after and before != after


def test_copies_of_an_adapter_share_an_identity_whatever_their_name(tmp_path: Path) -> None:
    digests = AdapterDigests(DigestCache(tmp_path / "c"))
    one = adapter(tmp_path / "one", b"\x03" * 100)
    two = adapter(tmp_path / "elsewhere" / "two", b"\x03" * 100)
    assert digests.extra(Request(Lora("x", str(one)))) == digests.extra(
        Request(Lora("y", str(two)))
    )


def test_an_adapter_that_is_no_local_path_is_named_by_name_and_path(tmp_path: Path) -> None:
    digests = AdapterDigests(DigestCache(tmp_path / "c"))
    hub = digests.extra(Request(Lora("a", "org/adapter")))
    assert hub and hub != digests.extra(Request(Lora("b", "org/adapter")))
