"""Which files of a local model directory the engine loads its weights from: the ones
the weights digest reads (:func:`kvoffload.core.identity.model.weights_digest`).

For vLLM's default loader (load formats :data:`DEFAULT_LOADER_FORMATS`) this is the
selection of vLLM 0.32's ``DefaultModelLoader._prepare_weights`` for a model's primary
weights, done the same way on a local directory:

- ``auto`` is ``mistral`` when a ``consolidated*.safetensors`` file exists, else
  ``hf``;
- each format has its patterns (``hf``: ``*.safetensors`` then ``*.bin``;
  ``safetensors``, ``fastsafetensors``, ``instanttensor``: ``*.safetensors``;
  ``mistral``: ``consolidated*.safetensors``; ``pt``: ``*.pt``; ``npcache``:
  ``*.bin``), followed by ``*.pt`` for the formats that are not safetensors-only;
  the first pattern that matches any file decides, and only its files are read;
- safetensors files are filtered to those the index names
  (``model.safetensors.index.json``, ``consolidated.safetensors.index.json`` for
  ``mistral``) when it exists; other files lose the training leftovers vLLM skips
  (``training_args.bin``, ``optimizer.bin``, ``optimizer.pt``, ``scheduler.pt``,
  ``scaler.pt``).

So a checkpoint directory that also holds ``pytorch_model.bin``, ``tf_model.h5`` or an
optimizer state beside its safetensors files is digested from the safetensors files
alone, as vLLM loads it. Not mirrored: a model class's own choices, known only once vLLM
built it (``allow_patterns_overrides``, ``fall_back_to_pt_during_load``, and
``secondary_weights`` read from other files): the live fingerprints every worker sends
(decision 0019) cover the weights as loaded.

Other load formats (``sharded_state``, ``runai_streamer``, ``tensorizer``, ``dummy``, a
loader registered by a plugin, ...) read files kvoffload does not model: every
top-level file with a weight suffix (:data:`WEIGHT_SUFFIXES`) is read, as before.

Pure Python, reads directory listings and the index file only; never raises: an
unlistable directory gives no files (the caller digests the error), an unreadable or
malformed index is ignored (vLLM then refuses to load the model anyway).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Sequence
from pathlib import Path

DEFAULT_LOADER_FORMATS = frozenset(
    {"auto", "hf", "safetensors", "fastsafetensors", "instanttensor", "mistral", "pt", "npcache"}
)
"""The load formats vLLM's ``DefaultModelLoader`` serves (whose file choice is mirrored)."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
MISTRAL_INDEX = "consolidated.safetensors.index.json"
TRAINING_FILES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
"""Files vLLM skips among ``*.bin`` and ``*.pt`` (a trainer's state, not weights)."""

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".npz",
    ".msgpack",
    ".h5",
)
"""The files read for a load format whose choice is not mirrored."""

MAX_INDEX_BYTES = 64 << 20
"""A larger index is not read (no real one comes close)."""

_SAFETENSORS_ONLY = {"safetensors", "fastsafetensors", "instanttensor", "mistral"}
_PATTERNS = {
    "hf": ("*.safetensors", "*.bin"),
    "safetensors": ("*.safetensors",),
    "fastsafetensors": ("*.safetensors",),
    "instanttensor": ("*.safetensors",),
    "mistral": ("consolidated*.safetensors",),
    "pt": ("*.pt",),
    "npcache": ("*.bin",),
}


def loaded_files(directory: Path, load_format: str | None = None) -> list[Path]:
    """The files of ``directory`` the engine loads weights from under
    ``load_format`` (None: ``auto``), in name order (module docstring). Raises
    ``OSError`` only when the directory cannot be listed."""
    names = _file_names(directory)
    fmt = (load_format or "auto").lower()
    if fmt not in DEFAULT_LOADER_FORMATS:
        return [directory / n for n in names if n.endswith(WEIGHT_SUFFIXES)]
    if fmt == "auto":
        consolidated = any(fnmatch.fnmatchcase(n, "consolidated*.safetensors") for n in names)
        fmt = "mistral" if consolidated else "hf"
    patterns = list(_PATTERNS[fmt])
    if fmt not in _SAFETENSORS_ONLY:
        patterns.append("*.pt")  # vLLM's fall_back_to_pt, on by default
    safetensors = fmt in _SAFETENSORS_ONLY
    chosen: list[str] = []
    for pattern in patterns:
        chosen = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if chosen:
            safetensors = safetensors or pattern.endswith(".safetensors")
            break
    if safetensors:
        index = MISTRAL_INDEX if fmt == "mistral" else SAFETENSORS_INDEX
        named = _indexed_names(directory / index)
        if named is not None:
            chosen = [n for n in chosen if n in named]
    else:
        chosen = [n for n in chosen if not n.endswith(TRAINING_FILES)]
    return [directory / n for n in chosen]


def config_files(directory: Path, endings: Sequence[str]) -> list[Path]:
    """The ``*.json`` files of ``directory`` whose names end with one of ``endings``,
    in name order: how vLLM finds a quantization method's own config file (its
    ``get_config_filenames()``) when the model's config holds none. Raises ``OSError``
    only when the directory cannot be listed."""
    wanted = tuple(e for e in endings if e)
    if not wanted:
        return []
    return [
        directory / n for n in _file_names(directory) if n.endswith(".json") and n.endswith(wanted)
    ]


def _file_names(directory: Path) -> list[str]:
    """The names of ``directory``'s files (links followed) that a glob matches (not
    hidden), sorted."""
    names = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_file():
                    names.append(entry.name)
            except OSError:
                continue
    return sorted(names)


def _indexed_names(index: Path) -> set[str] | None:
    """The file names a safetensors index's ``weight_map`` names, or None when there
    is no usable index (vLLM: no filter when it does not exist)."""
    try:
        with open(index, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
        if len(raw) > MAX_INDEX_BYTES:
            return None
        weight_map = json.loads(raw)["weight_map"]
        return {str(name) for name in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
