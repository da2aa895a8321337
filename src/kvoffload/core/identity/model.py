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
path's weight files by content: the files the engine loads
(:mod:`.weight_files`), read once per node (:mod:`.content_digest`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvoffload.core.identity import content_digest, weight_files
from kvoffload.core.identity.weight_files import loaded_files

DIGEST_BYTES = 12
"""Digests are 12 bytes, 24 hex digits (as the layout digest)."""

MAX_DEPTH = 12
"""Deeper values are cut to their type name (no configuration nests this deep)."""


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


def weights_digest(
    path: str | os.PathLike[str],
    cache: content_digest.DigestCache | None = None,
    *,
    load_format: str | None = None,
    config: Sequence[str] = (),
) -> str:
    """A digest of the weight files at a local model ``path``, or ``""`` when
    ``path`` is neither a directory nor a file (a hub model id).

    A directory contributes the files the engine loads its weights from under
    ``load_format`` (:func:`~kvoffload.core.identity.weight_files.loaded_files`: vLLM's
    default loader's choice, e.g. the safetensors files the index names and not a
    ``pytorch_model.bin`` or ``optimizer.pt`` beside them; None: ``auto``), then the
    config files the loader reads beside them whose names end with one of ``config``
    (:func:`~kvoffload.core.identity.weight_files.config_files`: a quantization
    method's own file); a file (a GGUF model) itself. Per file: its name, its size and the
    digest of its whole content (:mod:`kvoffload.core.identity.content_digest`: read
    once per node and remembered until the file changes; ``cache`` defaults to the
    process's shared one, :meth:`~.content_digest.DigestCache.default`). An in-place
    rewrite of any tensor changes it; copies of the same files on other machines give
    the same one. A file that cannot be read contributes its name and the error, so
    the digest stays deterministic."""
    root = Path(path)
    try:
        if root.is_dir():
            files = loaded_files(root, load_format) + weight_files.config_files(root, config)
        elif root.is_file():
            files = [root]
        else:
            return ""
    except OSError as exc:
        return digest_of(["unlistable", type(exc).__name__])
    digests = content_digest.digest_files(files, cache)
    return digest_of([file_identity(f, d) for f, d in zip(files, digests, strict=True)])


def file_identity(path: Path, digest: str) -> list[object]:
    """What :func:`weights_digest` records of one file (see there)."""
    try:
        size: object = path.stat().st_size
    except OSError:
        size = "unreadable"
    return [path.name, size, digest]
