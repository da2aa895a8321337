"""Sealing and opening one chunk (decision 0024): AES-256-GCM from ``cryptography``
(OpenSSL underneath: AES-NI and carry-less multiplication where the CPU has them).

:meth:`Sealer.seal_into` writes a chunk's sealed form (:mod:`.layout`) into a caller's
buffer: a fresh 96-bit nonce from ``os.urandom`` for every write, under the key file's
first key. Random nonces keep the bound NIST gives for them: at most 2^32 chunks
sealed under one key (4 PB of 1 MiB chunks) before the key should be rotated
(``kvoffload seal-key rotate``).

:meth:`Sealer.open_into` checks a sealed chunk and writes its plaintext into the
caller's buffer; anything that does not open raises :class:`SealError` (a value of
another format, an unknown key id, a length that does not fit, a tag that does not
match: tampered, swapped, truncated or sealed for another chunk or namespace). The
output buffer may then hold nothing useful; the caller treats it as unverified and
never hands it to the engine. Both are thread-safe (the cipher objects hold no
per-call state) and copy nothing beyond the cipher's own pass.
"""

from __future__ import annotations

import os

from kvoffload.core.errors import ConfigError
from kvoffload.sealing.keyfile import OPTION, SealKeys
from kvoffload.sealing.layout import (
    MAGIC,
    NONCE_BYTES,
    PREFIX_BYTES,
    TAG_BYTES,
    VERSION,
    SealContext,
    associated_data,
    decode_prefix,
    encode_prefix,
)


class SealError(ValueError):
    """A sealed chunk that must not be used; the message says why (never the key)."""


def _aesgcm() -> type:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ConfigError(
            OPTION,
            "sealing needs the cryptography package (46 or later): pip install 'kvoffload[seal]'",
        ) from None
    if not hasattr(AESGCM, "encrypt_into"):
        raise ConfigError(
            OPTION, "sealing needs cryptography 46 or later (AESGCM.encrypt_into): "
            "pip install -U cryptography",
        )  # fmt: skip
    cls: type = AESGCM
    return cls


class Sealer:
    """Seals with ``keys.sealing``, opens with any of ``keys``."""

    def __init__(self, keys: SealKeys) -> None:
        aesgcm = _aesgcm()
        self.keys = keys
        self._ciphers = {k.key_id: aesgcm(k.secret) for k in keys.keys}
        self._sealing = keys.sealing.key_id

    def seal_into(self, plain: memoryview, out: memoryview, context: SealContext) -> int:
        """Seal ``plain`` for ``context`` into ``out`` (at least ``len(plain)`` +
        :data:`~.layout.SEAL_BYTES` bytes); the sealed length."""
        n = len(plain)
        if len(out) < n + PREFIX_BYTES + TAG_BYTES:
            raise ValueError(f"a buffer of {len(out)} bytes cannot hold {n} bytes sealed")
        nonce = os.urandom(NONCE_BYTES)
        prefix = encode_prefix(self._sealing, nonce, n)
        out[:PREFIX_BYTES] = prefix
        end = PREFIX_BYTES + n + TAG_BYTES
        self._ciphers[self._sealing].encrypt_into(
            nonce, plain, associated_data(prefix, context), out[PREFIX_BYTES:end]
        )
        return end

    def open_into(self, sealed: memoryview, out: memoryview, context: SealContext) -> int:
        """Open the sealed chunk at the front of ``sealed`` (a buffer at least as long
        as it; its length is in its prefix) into ``out``; the plaintext's length.
        :class:`SealError` when it does not open (module docstring)."""
        try:
            prefix = decode_prefix(sealed)
        except ValueError as exc:
            raise SealError(str(exc)) from None
        if prefix.magic != MAGIC or prefix.version != VERSION:
            raise SealError("not a sealed chunk (unsealed, or another format)")
        cipher = self._ciphers.get(prefix.key_id)
        if cipher is None:
            raise SealError(f"sealed under key {prefix.key_id:08x}, not in the key file")
        n = prefix.length
        end = PREFIX_BYTES + n + TAG_BYTES
        if n > len(out) or end > len(sealed):
            raise SealError(f"a length of {n} bytes does not fit")
        try:
            cipher.decrypt_into(
                prefix.nonce,
                sealed[PREFIX_BYTES:end],
                associated_data(sealed[:PREFIX_BYTES], context),
                out[:n],
            )
        except Exception as exc:  # InvalidTag, or a buffer the library refuses
            raise SealError(f"does not open ({type(exc).__name__})") from None
        return n
