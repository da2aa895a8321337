"""Copy threads run torch single-threaded without touching anyone else's setting."""

from __future__ import annotations

import threading

import pytest
import torch

from kvoffload.transfer.threads import copy_executor

OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@pytest.mark.skipif(not OPENMP, reason="torch does not use OpenMP here")
def test_copy_threads_are_single_threaded_and_others_keep_their_setting() -> None:
    before = torch.get_num_threads()
    executor = copy_executor("kvoffload-test")
    try:
        assert executor.submit(torch.get_num_threads).result() == 1
    finally:
        executor.shutdown()
    assert torch.get_num_threads() == before
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [before], "a thread created later keeps the process default"
