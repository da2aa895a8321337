"""LoRA adapters identified by content in a request's keys (decision 0019).

vLLM's block hashes name a request's LoRA adapter by its name and path only, so an
adapter rewritten in place (retrained, merged, copied over) would keep its chunks'
keys. The scheduler half adds the adapter's content digest to the seed of the
request's key chain (:attr:`RequestTable.key_extra
<kvoffload.core.scheduler.requests.RequestTable>`): every file of a local adapter
directory (or the adapter file itself), each read in full and remembered until it
changes (:mod:`kvoffload.core.identity.content_digest`). An adapter that is not a local path
(a hub id vLLM resolves itself) is named by its name and path, as vLLM names it.

The digest is taken when the request is first seen. vLLM loads the adapter when the
request first runs and keeps it loaded; an adapter rewritten while vLLM keeps the
old one loaded is a gap vLLM's own prefix cache has too (its keys also stay).

Owned by the scheduler half; called on its thread. Never raises.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvoffload.core.identity import content_digest
from kvoffload.core.identity import model as model_identity


class AdapterDigests:
    """The content digest of each LoRA adapter requests name (module docstring)."""

    def __init__(self, cache: content_digest.DigestCache | None = None) -> None:
        self._cache = cache

    def extra(self, request: Any) -> bytes:
        """What ``request``'s LoRA adapter adds to its keys (b"" without one)."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return b""
        path = str(getattr(lora, "lora_path", "") or "")
        name = str(getattr(lora, "lora_name", "") or "")
        return self.digest(name, path).encode()

    def digest(self, name: str, path: str) -> str:
        """The adapter at ``path``'s content digest (its name and path when it is not
        a local path)."""
        root = Path(path)
        try:
            if root.is_dir():
                with os.scandir(root) as entries:
                    files = sorted(Path(e.path) for e in entries if e.is_file())
            elif root.is_file():
                files = [root]
            else:
                return model_identity.digest_of(["lora", "by name", name, path])
        except OSError as exc:
            return model_identity.digest_of(["lora", "unlistable", path, type(exc).__name__])
        digests = content_digest.digest_files(files, self._cache)
        return model_identity.digest_of(
            ["lora", [[f.name, d] for f, d in zip(files, digests, strict=True)]]
        )
