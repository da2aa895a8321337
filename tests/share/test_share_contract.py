"""The directory contract (tests/contract/test_directory_contract.py), run unchanged
against a :class:`ShareDirectory` whose node process serves from a thread: every
``Directory(...)`` the contract builds is a fresh share and a client of it."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from share_fixtures import ThreadShares

from kvoffload.core.policies import policy_names
from kvoffload.share.client import ShareDirectory
from kvoffload.share.meta import ShareGeometry

CONTRACT = Path(__file__).parents[1] / "contract" / "test_directory_contract.py"
NOT_FOR_A_SHARE = {
    "test_restore_adopts_chunks_in_their_slots_oldest_first": "a share is never restored",
    "test_integrity_check_catches_corruption": "reaches into a Directory's private table",
    "test_illegal_transitions_raise": "builds no directory",
}


def _contract() -> ModuleType:
    spec = importlib.util.spec_from_file_location("share_directory_contract", CONTRACT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = [
    name
    for name, test in inspect.getmembers(_contract(), inspect.isfunction)
    if name.startswith("test_") and name not in NOT_FOR_A_SHARE
]


def test_every_contract_case_is_run_or_excused() -> None:
    names = {n for n, _ in inspect.getmembers(_contract(), inspect.isfunction)}
    assert {n for n in names if n.startswith("test_")} == set(CASES) | set(NOT_FOR_A_SHARE)


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("case", CASES)
def test_directory_contract(case: str, policy: str, shares: ThreadShares) -> None:
    module = _contract()
    count = 0

    def share_directory(
        num_slots: int,
        *,
        tier: str = "host",
        policy: str = "lru",
        store_threshold: int = 1,
        max_admission_counters: int = 65536,
    ) -> ShareDirectory:
        nonlocal count
        count += 1
        geometry = ShareGeometry(num_slots, 64, 1, policy, store_threshold, max_admission_counters)
        paths = shares.serve(f"contract{count}", geometry)
        return shares.client(paths, tier=tier, lease=False)

    module.Directory = share_directory
    test: Any = getattr(module, case)
    if "policy" in inspect.signature(test).parameters:
        test(policy)
    elif policy == policy_names()[0]:
        test()
