"""The model identity in kvoffload's namespace, read from vLLM's configuration.

Decision 0010: a chunk's namespace covers everything that changes KV values. This
module reads from a ``VllmConfig`` what reaches the forward pass and digests it
(:mod:`kvoffload.core.identity.model` does the hashing):

- :func:`config_digest`: the Hugging Face config after vLLM applied ``hf_overrides``
  (``hf_config``, and ``hf_text_config`` when it is another object), including rope
  scaling and a checkpoint's ``quantization_config``; vLLM's quantization method and
  quantization arguments; the model dtype; the KV cache dtype and the layers it
  skips; and the few engine settings that change what a layer computes (remote-code
  revision, model implementation, sliding window disabled, load format, non-causal
  attention). Left out: ``_name_or_path`` (the model name is in the namespace already)
  and ``transformers_version`` (the writer's library version).
- :func:`weights_digest`: a local model directory's (or file's) weight files by
  content, only those vLLM's loader reads for the configured load format, and the
  quantization method's own config file
  (:func:`kvoffload.core.identity.model.weights_digest`); for a hub model the commit
  its revision resolves to in the local Hugging Face cache, else the revision string.

The configuration files that reach the forward pass are in :func:`config_digest`
already, as vLLM read them: ``config.json`` (as ``hf_config``, after
``hf_overrides``) with its ``quantization_config``; a quantization method's own file
(read by vLLM when the config has none) is digested with the weights.

Both halves call this from ``derive_geometry`` with the same configuration and get
the same digests. Nothing here raises for an unusual configuration: a value that
cannot be read contributes a fixed placeholder, so an engine start never fails here.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvoffload.core.identity import model as model_identity

IGNORED_HF_KEYS = frozenset({"_name_or_path", "transformers_version"})
"""Hugging Face config keys that never change KV values (at any nesting depth)."""

_COMMIT = re.compile(r"[0-9a-f]{40}")


def config_digest(vllm_config: Any) -> str:
    """The digest of everything in ``vllm_config`` that reaches the forward pass
    (module docstring). Reads only; never raises."""
    return model_identity.digest_of(config_document(vllm_config))


def config_document(vllm_config: Any) -> dict[str, object]:
    """What :func:`config_digest` digests, as canonical JSON data."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    load = getattr(vllm_config, "load_config", None)
    attention = getattr(vllm_config, "attention_config", None)
    quant = getattr(vllm_config, "quant_config", None)
    hf_config = getattr(model, "hf_config", None)
    hf_text_config = getattr(model, "hf_text_config", None)
    document: dict[str, object] = {
        "hf_config": _hf_dict(hf_config),
        "hf_text_config": None if hf_text_config is hf_config else _hf_dict(hf_text_config),
        "dtype": str(getattr(model, "dtype", None)),
        "quantization": getattr(model, "quantization", None),
        "quantization_config": getattr(model, "quantization_config", None),
        "quant_method": None if quant is None else _quant_name(quant),
        "cache_dtype": getattr(cache, "cache_dtype", None),
        "kv_cache_dtype_skip_layers": getattr(cache, "kv_cache_dtype_skip_layers", None),
        "code_revision": getattr(model, "code_revision", None),
        "model_impl": getattr(model, "model_impl", None),
        "disable_sliding_window": getattr(model, "disable_sliding_window", None),
        "load_format": getattr(load, "load_format", None),
        "use_non_causal": getattr(attention, "use_non_causal", None),
        "indexer_kv_dtype": getattr(attention, "indexer_kv_dtype", None),
    }
    canonical = model_identity.canonical(document)
    assert isinstance(canonical, dict)
    return canonical


def weights_digest(vllm_config: Any) -> str:
    """The digest of the weights' identity (module docstring). Never raises.

    Cost: each file's bytes are read once per node, not once per process: the
    scheduler half and every worker call this at start, and the first to reach a file
    reads it while the others wait on that file's lock in the shared digest cache and
    then take its entry (:mod:`kvoffload.core.identity.content_digest`; the user's
    cache folder, else a private folder in the temporary directory, named once by a
    warning). A second call in one process reads nothing.

    Why a worker uses the same digest as its scheduler half: both select the same files
    from the same configuration (load format, paths, quantization method), a digest is
    a pure function of the files' bytes, and a remembered digest is reused only while
    the file's stat signature (device, inode, size, modification and change times) is
    the one it was computed under, so a process either takes the digest another
    process computed from the very same, unchanged file, or reads the file itself. A
    file rewritten between the two derivations gives two digests: each worker sends
    the namespace it derived with its first report, and the scheduler half counts the
    mismatch (``namespace_mismatch``, decision 0010); chunks then never verify across
    the two (a miss, never wrong KV)."""
    model = getattr(vllm_config, "model_config", None)
    load = getattr(vllm_config, "load_config", None)
    name = str(getattr(model, "model", "") or "")
    separate = str(getattr(model, "model_weights", "") or "")  # a loader's own weights path
    local = [p for p in (name, separate) if p and os.path.exists(p)]
    if local:
        load_format = getattr(load, "load_format", None)
        fmt = load_format if isinstance(load_format, str) else None
        config = quant_config_files(vllm_config)
        return model_identity.digest_of(
            [
                "files",
                *(model_identity.weights_digest(p, load_format=fmt, config=config) for p in local),
            ]
        )
    revision = getattr(model, "revision", None) or "main"
    download_dir = getattr(load, "download_dir", None)
    commit = resolved_revision(name, revision, download_dir)
    return model_identity.digest_of(["hub", name, commit])


def quant_config_files(vllm_config: Any) -> tuple[str, ...]:
    """The name endings of the config files the quantization method vLLM built reads
    beside the weights (its ``get_config_filenames()``); none without quantization or
    when it names none. Never raises."""
    quant = getattr(vllm_config, "quant_config", None)
    if quant is None:
        return ()
    try:
        names = type(quant).get_config_filenames()
    except Exception:  # the base class raises for a method that reads no file of its own
        return ()
    if not isinstance(names, (list, tuple)):
        return ()
    return tuple(n for n in names if isinstance(n, str))


def resolved_revision(repo_id: str, revision: str, cache_dir: str | None = None) -> str:
    """The commit ``revision`` of hub model ``repo_id`` resolves to in the local
    Hugging Face cache (``cache_dir``, vLLM's ``download_dir``, or the default cache:
    vLLM downloaded the model there before the KV cache exists), or ``revision``
    itself when it is a commit or cannot be resolved offline."""
    if _COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            repo_id, "config.json", cache_dir=cache_dir, revision=revision
        )
    except Exception:  # no huggingface_hub, a bad repo id: the revision as given
        return revision
    if isinstance(found, str):
        commit = os.path.basename(os.path.dirname(found))
        if _COMMIT.fullmatch(commit):
            return commit
    return revision


def _hf_dict(config: Any) -> object:
    if config is None:
        return None
    return _without_ignored(model_identity.canonical(config))


def _without_ignored(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_ignored(v) for k, v in value.items() if k not in IGNORED_HF_KEYS}
    if isinstance(value, list):
        return [_without_ignored(v) for v in value]
    return value


def _quant_name(quant: Any) -> str:
    try:
        return f"{type(quant).__qualname__}:{quant.get_name()}"
    except Exception:
        return type(quant).__qualname__
