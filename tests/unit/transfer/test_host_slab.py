"""The host slab: sizing from a budget, zero-copy slot views."""

from __future__ import annotations

import pytest
import torch

from kvoffload.core.errors import ConfigError, ContractViolation
from kvoffload.tiers.host import HostSlab


def test_slots_come_from_the_budget() -> None:
    slab = HostSlab(4096, 10 * 4096 + 4095, pin_memory=False)
    assert (slab.num_slots, slab.chunk_bytes, slab.nbytes) == (10, 4096, 40960)
    assert slab.data.shape == (10, 4096) and slab.data.dtype == torch.uint8
    assert not slab.pinned


@pytest.mark.parametrize(
    ("chunk", "budget", "field"),
    [(4096, 4095, "host.budget_bytes"), (0, 4096, "chunk_bytes"), (4096, 1.5, "host.budget_bytes")],
)
def test_bad_sizes_are_config_errors(chunk: int, budget: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        HostSlab(chunk, budget, pin_memory=False)
    assert info.value.field == field


def test_slot_bytes_is_a_writable_zero_copy_view() -> None:
    slab = HostSlab(64, 4 * 64, pin_memory=False, prefault=False)
    view = slab.slot_bytes(2)
    assert isinstance(view, memoryview) and not view.readonly and view.nbytes == 64
    view[:] = bytes(range(64))
    assert slab.slot_tensor(2).tolist() == list(range(64))
    slab.slot_tensor(1).fill_(7)
    assert bytes(slab.slot_bytes(1)) == b"\x07" * 64
    assert bytes(slab.slot_bytes(3)) == bytes(64)


def test_typed_views_share_memory() -> None:
    slab = HostSlab(64, 2 * 64, pin_memory=False)
    words = slab.view(torch.int64)
    assert words.shape == (2, 8)
    words[1, 0] = 0x0102030405060708
    assert bytes(slab.slot_bytes(1))[:8] == (0x0102030405060708).to_bytes(8, "little")


def test_misuse_is_a_contract_violation() -> None:
    slab = HostSlab(6, 12, pin_memory=False)
    with pytest.raises(ContractViolation):
        slab.slot_bytes(2)
    with pytest.raises(ContractViolation):
        slab.slot_tensor(-1)
    with pytest.raises(ContractViolation):
        slab.view(torch.int64)
