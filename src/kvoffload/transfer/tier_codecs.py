"""A lower tier's store seen through codecs (issue 33, decision 0023).

Host slots hold chunks in host memory's codec; a lower tier may keep them in another
(``<tier>_codec``: host memory ``none``, disk and Redis ``fp8``), and a tier keyed by
chunk (Redis) stores only the bytes a variable-size codec (``lossless``) uses.
:class:`CodecTierStore` wraps a tier's :class:`~kvoffload.tiers.spec.TierStore` so the
tier lane and the staged loads keep reading and writing host-format chunks:

- ``write_many``: each host slot is decoded (host codec) and encoded (tier codec)
  into a buffer of the tier's chunk bytes, trimmed to its used bytes for a tier keyed
  by chunk; the tier checksums what it stores. A chunk the tier codec cannot encode
  (fp8: a value not finite), or whose host slot does not decode (its frame checksum
  does not match), fails alone (``io:codec ...``), never written;
- ``read_many``: the tier reads into buffers of its chunk bytes; each chunk read is
  decoded (tier codec) and encoded (host codec) into its host slot. A chunk that
  does not decode (among others one whose frame checksum does not match, issue 41)
  fails as ``integrity:codec`` (the reason is ``codec`` alone: a bounded metric
  label; the scheduler half forgets the copy; the engine recomputes); a host slot
  whose chunk failed may hold partial bytes, as with any failed read. Where the codecs
  agree the bytes pass through undecoded, and the frame's checksum is checked when
  the host slot is decoded (its load).

Everything else (``hold``, ``close``, ``delete_many``...) is the wrapped store's.
Called from the tier lane's threads, one call per thread: each call has its own
buffers, and :meth:`CodecTierStore.last_moved` gives the calling thread the bytes its
last call moved at the tier (the chunks that made it, as the tier keeps them: what
crosses a remote tier's link), which the tier lane reports as its jobs' bytes.
Contract of the wrapped store unchanged: failures per chunk, raises only when the
tier failed as a whole.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from kvoffload.codecs.chunk_codec import ChunkCodec
from kvoffload.core.failures import ChunkFailure, integrity_failure, io_failure
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.spec import TierStore

__all__ = ["CodecTierStore", "through_codecs"]


def _name(codec: ChunkCodec | None) -> str:
    return "none" if codec is None else codec.name


def _tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)


class CodecTierStore:
    """``inner`` (a tier keeping ``tier``-coded chunks) as host slots in ``host``'s
    codec see it (see the module docstring). ``raw_bytes``: one rank's raw chunk;
    ``keyed``: the tier is keyed by chunk, so it stores only the used bytes."""

    def __init__(
        self,
        inner: TierStore,
        host: ChunkCodec | None,
        tier: ChunkCodec | None,
        *,
        raw_bytes: int,
        keyed: bool,
    ) -> None:
        self.inner = inner
        self.host = host
        self.tier = tier
        self.raw_bytes = raw_bytes
        self.keyed = keyed
        self.same = _name(host) == _name(tier)
        self._local = threading.local()

    def last_moved(self) -> int | None:
        """The bytes the calling thread's last call moved at the tier (None: no call)."""
        moved: int | None = getattr(self._local, "moved", None)
        return moved

    @property
    def tier_bytes(self) -> int:
        return self.raw_bytes if self.tier is None else self.tier.stored_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _raw(self, view: memoryview) -> torch.Tensor:
        """A host slot's raw chunk; ``ValueError`` naming host memory's codec when the
        slot does not decode."""
        if self.host is None:
            return _tensor(view)
        raw = torch.empty(self.raw_bytes, dtype=torch.uint8)
        try:
            self.host.decode(_tensor(view), raw)
        except ValueError as exc:
            raise ValueError(f"host slot ({exc})") from exc
        return raw

    def _encoded(self, view: memoryview) -> memoryview:
        """A host slot's chunk as the tier keeps it (``ValueError``: not encodable)."""
        if self.same:
            data = view
        else:
            raw = self._raw(view)
            if self.tier is None:
                return raw.numpy().data.cast("B")
            out = torch.zeros(self.tier.stored_bytes, dtype=torch.uint8)
            self.tier.encode(raw, out)
            data = out.numpy().data.cast("B")
        if self.keyed and self.tier is not None:
            data = data[: self.tier.used_bytes(data)]
        return data

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        failures: list[ChunkFailure | None] = [None] * len(items)
        kept: list[int] = []
        encoded: list[tuple[ChunkKey, memoryview]] = []
        for i, (key, view) in enumerate(items):
            try:
                encoded.append((key, self._encoded(view)))
                kept.append(i)
            except ValueError as exc:
                failures[i] = io_failure(f"codec {_name(self.tier)}: {exc}")
        if kept:
            done = self.inner.write_many(
                encoded,
                [slots[i] for i in kept] if slots else (),
                [groups[i] for i in kept] if groups else (),
            )
            for i, failure in zip(kept, done, strict=True):
                failures[i] = failure
        self._local.moved = sum(
            len(view) for i, (_, view) in zip(kept, encoded, strict=True) if failures[i] is None
        )
        return failures

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        if self.same:
            failures = self.inner.read_many(keys, slots, outs, groups)
            self._local.moved = sum(
                self._used(out) for out, f in zip(outs, failures, strict=True) if f is None
            )
            return failures
        buffers = [torch.empty(self.tier_bytes, dtype=torch.uint8) for _ in keys]
        views = [b.numpy().data.cast("B") for b in buffers]
        failures = self.inner.read_many(keys, slots, views, groups)
        for i, failure in enumerate(failures):
            if failure is not None:
                continue
            try:
                raw = buffers[i]
                if self.tier is not None:
                    raw = torch.empty(self.raw_bytes, dtype=torch.uint8)
                    self.tier.decode(buffers[i], raw)
                out = _tensor(outs[i])
                if self.host is None:
                    out.copy_(raw)
                else:
                    self.host.encode(raw, out)
            except ValueError:
                failures[i] = integrity_failure("codec")
        self._local.moved = sum(
            self._used(view) for view, f in zip(views, failures, strict=True) if f is None
        )
        return failures

    def _used(self, view: memoryview) -> int:
        """The bytes a chunk read in the tier's codec took at the tier."""
        if self.tier is None or not self.keyed:
            return len(view)
        try:
            return self.tier.used_bytes(view)
        except ValueError:
            return len(view)


def through_codecs(
    store: TierStore,
    host: ChunkCodec | None,
    tier: ChunkCodec | None,
    *,
    raw_bytes: int,
    keyed: bool,
) -> TierStore:
    """``store`` as host slots see it: itself when the codecs agree and nothing is
    trimmed, else a :class:`CodecTierStore`."""
    variable = tier is not None and tier.name == "lossless"
    if _name(host) == _name(tier) and not (keyed and variable):
        return store
    return CodecTierStore(store, host, tier, raw_bytes=raw_bytes, keyed=keyed)
