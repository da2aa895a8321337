"""Copy threads that run torch operators single-threaded.

Torch parallelises large CPU operators with OpenMP, sized by a process-wide thread
count. A transfer thread calling ``index_select`` would then start an OpenMP team of
its own next to the engine's (on the reference machine a 2 MiB gather with two
OpenMP threads was up to 8x slower than with one), and ``torch.set_num_threads``
cannot help: it also changes the default of every thread created later.

:func:`single_threaded_torch` limits only the calling thread: it lets torch
initialise the thread's OpenMP settings, then calls ``omp_set_num_threads(1)`` of the
OpenMP runtime torch loaded, which is per thread. Where no such runtime is loaded
(another threading backend) it does nothing, and copies stay correct, only
possibly slower.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.cache
def _omp_setters() -> tuple[Callable[[ctypes.c_int], object], ...]:
    """``omp_set_num_threads`` of every OpenMP runtime loaded, torch's own first."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return ()
    torch_dir = os.path.dirname(torch.__file__)
    setters = []
    for path in sorted(paths, key=lambda p: (not p.startswith(torch_dir), p)):
        try:
            setters.append(ctypes.CDLL(path).omp_set_num_threads)
        except (OSError, AttributeError):
            continue
    return tuple(setters)


def single_threaded_torch() -> None:
    """Make torch CPU operators called from *this* thread run on this thread only."""
    torch.get_num_threads()  # torch's lazy per-thread init; must precede the override
    for setter in _omp_setters():
        setter(ctypes.c_int(1))
        if torch.get_num_threads() == 1:
            return


def copy_executor(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A thread pool whose threads run torch operators single-threaded."""
    return ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix=name, initializer=single_threaded_torch
    )
