"""Digests of a model's identity: its configuration and its weight files.

Pure Python (no torch, no vLLM): the vLLM adapter (``adapters/vllm/identity.py``)
gathers the values, this module turns them into short, deterministic hex digests for
:class:`~kvoffload.core.keys.Namespace` (decision 0010). Every function here is
deterministic across processes and machines for the same inputs (no ``hash()``, no
object addresses, no dict order) and never raises for unusual values or unreadable
files: both halves of the connector must derive the same digest, and an engine start
must never fail here.

:func:`canonical` turns a configuration value into plain JSON data;
:func:`digest_of` digests such data; :func:`weights_digest` digests a local model
path's weight files from cheap reads only (see its docstring for what it reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

DIGEST_BYTES = 12
"""Digests are 12 bytes, 24 hex digits (as the layout digest)."""

MAX_DEPTH = 12
"""Deeper values are cut to their type name (no configuration nests this deep)."""

SAFETENSORS_SUFFIX = ".safetensors"
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack", ".h5")
"""Weight files that are not safetensors: identified by name, size and mtime."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""A safetensors header longer than this is taken as unreadable (safetensors caps
headers at 100 MB)."""

SAMPLE_BYTES = 64 * 1024
"""Bytes of tensor data read at the start, the middle and the end of a safetensors
file's data, so that weights replaced by others of the same shapes (a fine-tune)
change the digest without reading the whole file."""


def canonical(value: object, depth: int = 0) -> object:
    """``value`` as JSON data (dicts with string keys, lists, strings, numbers,
    booleans, None), the same in every process for equal values.

    Mappings and dataclasses become dicts; lists, tuples and sets lists (sets
    sorted); enums ``"Type.NAME"``; floats their ``repr`` (NaN and infinities
    included); a torch dtype its name without ``torch.`` (``"float32"``, as configs
    spell it); objects with a ``to_dict()`` (Hugging Face configs) that dict; other
    objects their public attributes, or ``str()`` when it is not the default
    ``<object at 0x...>`` form, else their type name. Never raises."""
    if depth > MAX_DEPTH:
        return f"<{type(value).__qualname__}>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {str(k): canonical(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [canonical(v, depth + 1) for v in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")  # as a config's dtype string names it
    try:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
            return canonical(fields, depth + 1)
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict):
            return canonical(to_dict(), depth + 1)
        if type(value).__repr__ is not object.__repr__ and " at 0x" not in str(value):
            return str(value)
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            public = {k: v for k, v in attributes.items() if not k.startswith("_")}
            return {"<type>": type(value).__qualname__, **canonical(public, depth + 1)}  # type: ignore[dict-item]
    except Exception:  # a property that raises: the type alone, deterministically
        pass
    return f"<{type(value).__qualname__}>"


def digest_of(document: object) -> str:
    """The hex digest of ``document``'s canonical JSON (sorted keys)."""
    text = json.dumps(canonical(document), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).hexdigest()


def weights_digest(path: str | os.PathLike[str]) -> str:
    """A digest of the weight files at a local model ``path``, or ``""`` when
    ``path`` is neither a directory nor a file (a hub model id).

    A directory contributes its top-level weight files in name order; a file (a
    GGUF model) itself. Per file: its name and size, and for ``*.safetensors`` the
    JSON header (tensor names, dtypes, shapes, offsets, metadata) and
    :data:`SAMPLE_BYTES` of tensor data at the start, middle and end of the data;
    for other weight files (:data:`OTHER_WEIGHT_SUFFIXES`) the modification time in
    nanoseconds instead. Reads a few small ranges per file, never a whole file. A
    file that cannot be read contributes what could be read (its name, and its size
    when ``stat`` works), so the digest stays deterministic."""
    root = Path(path)
    try:
        if root.is_dir():
            with os.scandir(root) as entries:
                names = sorted(e.name for e in entries if _is_weight_file(e.name))
            files = [root / name for name in names]
        elif root.is_file():
            files = [root]
        else:
            return ""
    except OSError as exc:
        return digest_of(["unlistable", type(exc).__name__])
    return digest_of([file_identity(f) for f in files])


def file_identity(path: Path) -> list[object]:
    """What :func:`weights_digest` records of one file (see there)."""
    out: list[object] = [path.name]
    try:
        stat = path.stat()
    except OSError:
        return [*out, "unreadable"]
    out.append(stat.st_size)
    if path.name.endswith(SAFETENSORS_SUFFIX):
        out += _safetensors_identity(path, stat.st_size)
    else:
        out.append(stat.st_mtime_ns)
    return out


def _is_weight_file(name: str) -> bool:
    return name.endswith(SAFETENSORS_SUFFIX) or name.endswith(OTHER_WEIGHT_SUFFIXES)


def _safetensors_identity(path: Path, size: int) -> list[object]:
    """The header's digest and the data samples' digest, or ``["unreadable"]``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return ["unreadable"]
    try:
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            return ["short"]
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            return ["bad header length", length]
        header = os.pread(fd, length, 8)
        start = 8 + length
        samples = hashlib.blake2b(digest_size=DIGEST_BYTES)
        for offset in sorted({start, start + (size - start) // 2, max(start, size - SAMPLE_BYTES)}):
            samples.update(os.pread(fd, SAMPLE_BYTES, offset))
        return [
            hashlib.blake2b(header, digest_size=DIGEST_BYTES).hexdigest(),
            samples.hexdigest(),
        ]
    except OSError:
        return ["unreadable"]
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
