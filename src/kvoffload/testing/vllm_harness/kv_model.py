"""The harness's model: KV that names the tokens it was computed from, and the check
that every forward pass reads exactly its own request's KV.

The KV of position ``p`` on rank ``r``, KV cache group ``g``, layer ``l`` is a number
derived from the weights version, ``r``, ``g``, ``l`` and a digest of the request's
tokens ``0..p``: equal prefixes have equal KV (as in a real model, so prefix caching
and offloading are meaningful), and a position holding anything else (another
request's KV, another position's, another group's, a torn copy, KV of the weights
before a reset) is detected. Layer ``l`` of every group is the same tensor (vLLM's
hybrid layout), reached through that group's block table. Each value is an integer
below 2**23, exact in float32. Sampled tokens are a function of the prefix digest,
so a resampled position gets the same token.

With a lossy chunk codec (fp8, issue 33) the checks accept each value within the
codec's bound (:func:`codec_tolerance`, set as :attr:`KVModel.tolerance`); a value
of another prefix is a random integer below 2**23, so a wrong position still fails
(each of its values passes by chance with probability about 2^-3, and every layer
and rank of it is checked).

Owned by one harness; the KV tensors are the workers' (one per rank).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvoffload.codecs.fp8 import E4M3_MAX

VOCAB = 1000
KV_MAX = float(1 << 23)
"""Every KV value is below this."""


def codec_tolerance(extra: dict[str, object]) -> tuple[float, float]:
    """``(relative, absolute)`` error a value read back may have under the codecs of
    kvoffload's options ``extra``: e4m3's bound (``codecs/fp8.py``: 2^-4 of the
    value plus 2^-10 of its run's scale, at most :data:`KV_MAX` / 448), twice over
    where tiers of different codecs may code a chunk with fp8 twice; (0, 0), exact,
    without fp8."""
    host = str(extra.get("codec", "none"))
    codecs = {host} | {str(v) for k, v in extra.items() if k.endswith("_codec") and v}
    if "fp8" not in codecs:
        return 0.0, 0.0
    times = 2.0 if len(codecs) > 1 else 1.0
    return times * 2.0**-4 * 1.001, times * 2.0**-10 * KV_MAX / E4M3_MAX * 1.001


@dataclass
class _Prefix:
    tokens: list[int]  # the tokens the digests were computed from
    digests: list[bytes]  # digests[p] names tokens[: p + 1]
    values: dict[tuple[int, int, int, int], list[float]]  # (version, rank, group, layer)


class ReadMismatch(AssertionError):
    """A forward pass would read KV that is not its request's own."""


class KVModel:
    def __init__(self, kv: list[torch.Tensor], block_size: int, null_block: int = 0) -> None:
        """``kv[rank]`` is that rank's ``[layers, blocks, heads, block_size, 2*head]``;
        ``null_block``: the engine's placeholder block, never written."""
        self.kv = kv
        self.block_size = block_size
        self.null_block = null_block
        self.version = 0  # bumped when the weights change (a full connector reset)
        self._prefixes: dict[str, _Prefix] = {}
        self.salts: dict[str, str] = {}  # a request's cache salt seeds its digests
        self._values: dict[tuple[bytes, int, int, int, int], float] = {}
        self.tolerance = (0.0, 0.0)  # (relative, absolute): see codec_tolerance

    def fingerprint(self, rank: int) -> bytes:
        """Rank ``rank``'s weights fingerprint: a function of the weights version."""
        return f"kv-model:v{self.version}:r{rank}".encode()

    def digests(self, request_id: str, tokens: list[int], end: int) -> list[bytes]:
        """Digests of ``tokens[: p + 1]`` for p < ``end``."""
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            prefix = self._prefixes[request_id] = _Prefix([], [], {})
        same = 0
        limit = min(len(prefix.tokens), len(tokens))
        while same < limit and prefix.tokens[same] == tokens[same]:
            same += 1
        if same < len(prefix.digests):
            del prefix.tokens[same:], prefix.digests[same:]
            for values in prefix.values.values():
                del values[same:]
        seed = b"kvoffload/harness/" + self.salts.get(request_id, "").encode()
        last = prefix.digests[-1] if prefix.digests else seed
        for p in range(same, end):
            last = hashlib.blake2b(last + tokens[p].to_bytes(4, "little"), digest_size=8).digest()
            prefix.tokens.append(tokens[p])
            prefix.digests.append(last)
        return prefix.digests[:end]

    def value(self, digest: bytes, rank: int, group: int, layer: int) -> float:
        key = (digest, self.version, rank, group, layer)
        found = self._values.get(key)
        if found is None:
            tag = bytes((self.version % 256, rank, group, layer))
            raw = hashlib.blake2b(digest + tag, digest_size=3).digest()
            found = self._values[key] = float(int.from_bytes(raw, "little") & 0x7FFFFF)
        return found

    def expected(
        self,
        request_id: str,
        tokens: list[int],
        start: int,
        end: int,
        *,
        rank: int,
        group: int,
        layer: int,
    ) -> torch.Tensor:
        """The KV values of positions ``start..end-1`` (this weights version)."""
        digests = self.digests(request_id, tokens, end)
        values = self._prefixes[request_id].values.setdefault(
            (self.version, rank, group, layer), []
        )
        for p in range(len(values), end):
            values.append(self.value(digests[p], rank, group, layer))
        return torch.tensor(values[start:end], dtype=torch.float32)

    def sample(self, request_id: str, tokens: list[int]) -> int:
        digest = self.digests(request_id, tokens, len(tokens))[-1]
        return 3 + int.from_bytes(digest[:4], "little") % VOCAB

    def reference_output(self, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
        """The tokens a request must produce: sampling depends only on its prefix."""
        scratch = request_id + "\x00reference"
        self.salts[scratch] = self.salts.get(request_id, "")
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(self.sample(scratch, tokens))
        self.forget(scratch)
        del self.salts[scratch]
        return tokens[len(prompt) :]

    def write(
        self,
        request_id: str,
        tokens: list[int],
        blocks: list[int],
        start: int,
        end: int,
        *,
        group: int,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Write group ``group``'s KV of positions ``start..end-1`` through its block
        table ``blocks`` on ``ranks`` (default: all); positions in the null block are
        not written."""
        for _, _, kv_layer, index, values in self._places(
            request_id, tokens, blocks, start, end, group=group, ranks=ranks
        ):
            keep = index[0] != self.null_block
            kv_layer[index[0][keep], :, index[1][keep], :] = values[keep].view(-1, 1, 1)

    def check(
        self,
        request_id: str,
        tokens: list[int],
        blocks: list[int],
        start: int,
        end: int,
        *,
        group: int,
        what: str,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Raise :class:`ReadMismatch` unless positions ``start..end-1`` of group
        ``group`` (through its block table ``blocks``) hold the request's own KV of
        that group (this weights version) on every rank and layer."""
        for rank, layer, kv_layer, index, want in self._places(
            request_id, tokens, blocks, start, end, group=group, ranks=ranks
        ):
            got = kv_layer[index[0], :, index[1], :]
            exact = want.view(-1, 1, 1)
            relative, absolute = self.tolerance
            if relative or absolute:
                close = (got - exact).abs() <= relative * exact.abs() + absolute
            else:
                close = got == exact
            ok = close.flatten(1).all(dim=1)
            if not bool(ok.all()):
                bad = start + int((~ok).nonzero()[0])
                block = blocks[bad // self.block_size]
                raise ReadMismatch(
                    f"{what}: request {request_id!r} position {bad} (group {group}, block "
                    f"{block}, rank {rank}, layer {layer}) does not hold its own KV"
                )

    def _places(
        self,
        request_id: str,
        tokens: list[int],
        blocks: list[int],
        start: int,
        end: int,
        *,
        group: int,
        ranks: Sequence[int] | None,
    ) -> Iterator[tuple[int, int, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """(rank, layer, that layer's KV, block and offset index, expected values) of
        group ``group``'s positions ``start..end-1`` on ``ranks`` (default: all)."""
        if end <= start:
            return
        index = self._index(blocks, start, end)
        for rank in ranks if ranks is not None else range(len(self.kv)):
            kv = self.kv[rank]
            for layer in range(kv.shape[0]):
                want = self.expected(
                    request_id, tokens, start, end, rank=rank, group=group, layer=layer
                )
                yield rank, layer, kv[layer], index, want

    def forget(self, request_id: str) -> None:
        self._prefixes.pop(request_id, None)

    def _index(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[positions // self.block_size], positions % self.block_size
