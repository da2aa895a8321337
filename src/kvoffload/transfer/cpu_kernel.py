"""The CPU copy kernel: indexed block records to indexed block records, in one pass.

``copy_records(src, src_idx, dst, dst_idx)`` copies record ``src[src_idx[i]]`` to
``dst[dst_idx[i]]`` for every ``i``; a record is ``[views, words]`` (the pages one
engine block has in one page group). torch and numpy offer an indexed gather or an
indexed scatter, never both in one pass, so kvoffload ships a small C kernel
(``_copykernel.c``, built at install): one pass, no GIL (threads can copy parts of
a job at once), non-temporal stores on x86-64. Where it could not be built, a numpy
two-pass copy does the same, slower.

Arrays may be strided (engine pages are views across layers) but each page (the
last axis) must be contiguous, and ``src`` and ``dst`` must not overlap. Indices are
checked against the arrays before any byte moves (a bad index raises IndexError).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

Records = npt.NDArray[Any]  # 3-D: [records, views, words]
Index = npt.NDArray[np.int64]


def _load_native() -> ModuleType | None:
    try:  # the compiled submodule itself (not an attribute of the package)
        return importlib.import_module("kvoffload.transfer._copykernel")
    except ImportError:
        return None


_NATIVE = _load_native()
NATIVE = _NATIVE is not None


def _check(records: Records, index: Index) -> None:
    if index.size and (int(index.min()) < 0 or int(index.max()) >= records.shape[0]):
        raise IndexError(f"record index out of range [0, {records.shape[0]})")


def copy_records(
    src: Records, src_idx: Index, dst: Records, dst_idx: Index, *, streaming: bool = True
) -> None:
    """Copy ``src[src_idx[i]]`` to ``dst[dst_idx[i]]`` for every ``i`` (module doc)."""
    if len(src_idx) != len(dst_idx) or src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError("copy_records: index lengths, record shapes and dtypes must match")
    _check(src, src_idx)
    _check(dst, dst_idx)
    itemsize = src.dtype.itemsize
    native = _NATIVE
    if native is None or src.strides[2] != itemsize or dst.strides[2] != itemsize:
        dst[dst_idx] = src[src_idx]
        return
    si = np.ascontiguousarray(src_idx, dtype=np.int64)
    di = np.ascontiguousarray(dst_idx, dtype=np.int64)
    native.copy_records(
        src.ctypes.data,
        src.strides[0],
        src.strides[1],
        dst.ctypes.data,
        dst.strides[0],
        dst.strides[1],
        src.shape[1],
        src.shape[2] * itemsize,
        si.ctypes.data,
        di.ctypes.data,
        len(si),
        streaming,
    )
