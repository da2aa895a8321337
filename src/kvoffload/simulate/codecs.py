"""Chunk codecs in ``kvoffload simulate`` (issue 33, decision 0023): what a tier's codec
does to a chunk's size (the tier's capacity, the bytes its lanes move) and what
encoding and decoding cost.

Codecs, by name (:data:`kvoffload.codecs.CODECS`):

- ``none``: a chunk is its raw bytes;
- ``lossless``: byte planes shuffled, then an entropy coder; bit-exact. Its ratio
  varies from chunk to chunk; the simulator gives every chunk the mean ratio
  (``--codec-ratio``, raw / encoded): ``ceil(raw / ratio)`` bytes and the frame's
  16-byte header (its length and checksum), in a tier keyed by chunk (Redis); a
  slotted tier (host memory, disk) keeps it in a slot of the raw size and
  :data:`LOSSLESS_OVERHEAD` bytes, as the engine does (decision 0023): no capacity
  gained there, only coding time spent. Defaults
  :data:`LOSSLESS_RATIO_16BIT` for 16-bit KV and :data:`LOSSLESS_RATIO_32BIT` for
  32-bit (measured on the demo model's KV: replace them with your model's). It runs
  on the CPU;
- ``fp8``: e4m3 with one fp32 scale per run of :data:`~kvoffload.codecs.FP8_RUN`
  elements, as :mod:`kvoffload.codecs.fp8` encodes, behind the frame's 8-byte
  checksum: ``8 + elements + 4 x ceil(elements / FP8_RUN)`` bytes, ``elements = raw /
  kv_dtype_bytes``. Lossy, opt-in; for 16- and 32-bit KV, refused for 8-bit KV.
  Between the engine and a tier the engine codes it on the GPU by default
  (``fp8_device="gpu"``, decision 0023: "on the GPU before the copy to host"), taken
  as free; with ``"cpu"``, the worker's copy threads code it.

Where the CPU codes (lossless; fp8 with ``fp8_device="cpu"``; any re-encoding
between two tiers of different codecs), it runs at ``encode_gbps`` / ``decode_gbps``
GB/s of raw bytes per engine (:data:`DEFAULT_GBPS` by codec unless given); the worker
charges that time on the lane that moves the chunk (:mod:`kvoffload.simulate.worker`).

Immutable; bad values raise :class:`~kvoffload.core.errors.UsageError` naming the
option. Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvoffload.codecs import CODECS, FP8_RUN, FRAME_CHECK_BYTES, LOSSLESS_OVERHEAD
from kvoffload.core.errors import UsageError

NONE, LOSSLESS, FP8 = "none", "lossless", "fp8"  # CODECS, by name

KV_DTYPE_BYTES = (1, 2, 4)
"""KV widths ``--kv-dtype-bytes`` accepts: fp8, bf16/fp16, fp32."""

FP8_DEVICES = ("gpu", "cpu")
"""Where fp8 codes a chunk moving between the engine and a tier (``--fp8-device``)."""

SCALE_BYTES = 4
"""One fp8 scale: fp32."""

LOSSLESS_RATIO_16BIT = 1.45
"""The lossless codec's mean ratio (raw / encoded) for 16-bit KV by default: measured
on the demo model's bfloat16 KV (``bench/codecs.py``, decision 0023: 1.454; its
float16 KV: 1.18, give ``--codec-ratio`` for that)."""
LOSSLESS_RATIO_32BIT = 1.18
"""The same for 32-bit KV (the demo model's float32 KV: 1.185)."""
LOSSLESS_FRAME = 8 + FRAME_CHECK_BYTES
"""Bytes a lossless chunk takes beyond its frame: the frame's length and checksum."""

DEFAULT_GBPS: dict[str, tuple[float, float]] = {
    # codec -> (encode, decode) on the CPU, GB/s of raw bytes, one engine.
    # fp8: bench/sim_codec_speed.py (kvoffload.codecs.fp8 on bf16, 64 KiB-4 MiB, one
    # torch thread) on a 2-core host: 0.8 / 0.7 unloaded (0.5 / 0.5 beside another
    # benchmark); decision 0023 measured 0.66-0.74 / 0.61-0.64 at 1 MiB.
    FP8: (0.8, 0.7),
    # lossless: decision 0023's measure of blosc2 shuffle + zstd 1 on the demo model's
    # bf16 KV, one core of the same host (bench/codecs.py, 1 MiB chunks).
    LOSSLESS: (0.59, 1.78),
}


@dataclass(frozen=True)
class TierCodec:
    """One tier's codec, applied to its chunks: ``raw_bytes`` before encoding,
    ``chunk_bytes`` encoded (what a slot of the tier holds and its own lane moves), the
    seconds per raw byte of encoding and decoding on the CPU (0 for ``none``), and
    whether the engine codes it on the GPU when a chunk moves between the engine and
    the tier (``gpu``: free there, and the engine's link moves encoded bytes; else the
    link moves raw bytes and the CPU codes them)."""

    name: str
    raw_bytes: int
    chunk_bytes: int
    encode_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    gpu: bool = False

    @classmethod
    def raw(cls, chunk_bytes: int) -> TierCodec:
        """No codec: chunks of ``chunk_bytes``, nothing to encode."""
        return cls(NONE, chunk_bytes, chunk_bytes)

    @property
    def ratio(self) -> float:
        """Raw bytes / encoded bytes (1 without a codec)."""
        return self.raw_bytes / self.chunk_bytes

    @property
    def engine_link_bytes(self) -> int:
        """Bytes one chunk takes on the link between the engine and the tier (a host
        copy, a tier load's staging copy): encoded when the GPU codes, else raw."""
        return self.chunk_bytes if self.gpu else self.raw_bytes

    def encode_seconds(self, chunks: int) -> float:
        """CPU time to encode ``chunks`` chunks."""
        return chunks * self.raw_bytes * self.encode_s_per_byte

    def decode_seconds(self, chunks: int) -> float:
        """CPU time to decode ``chunks`` chunks."""
        return chunks * self.raw_bytes * self.decode_s_per_byte

    def store_seconds(self, chunks: int) -> float:
        """Coding time of storing ``chunks`` chunks from the engine (0 on the GPU)."""
        return 0.0 if self.gpu else self.encode_seconds(chunks)

    def load_seconds(self, chunks: int) -> float:
        """Coding time of loading ``chunks`` chunks into the engine (0 on the GPU)."""
        return 0.0 if self.gpu else self.decode_seconds(chunks)


def transcode_seconds(source: TierCodec, destination: TierCodec, chunks: int) -> float:
    """CPU time to move ``chunks`` chunks between two tiers: nothing when both use the
    same codec (the encoded bytes move as they are), else decoding one and encoding
    the other."""
    if source.name == destination.name:
        return 0.0
    return source.decode_seconds(chunks) + destination.encode_seconds(chunks)


def _positive(value: float | None, option: str) -> None:
    if value is None:
        return
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise UsageError(f"{option}: must be a number > 0, got {value}")


@dataclass(frozen=True)
class CodecModel:
    """What every tier's codec shares: the KV's width (``kv_dtype_bytes``), the
    lossless ``ratio``, the CPU's encode and decode speeds (None: the codec's default)
    and where fp8 codes between the engine and a tier (``fp8_device``). Validated at
    construction."""

    kv_dtype_bytes: int = 2
    ratio: float | None = None
    encode_gbps: float | None = None
    decode_gbps: float | None = None
    fp8_device: str = "gpu"

    def __post_init__(self) -> None:
        if self.kv_dtype_bytes not in KV_DTYPE_BYTES:
            raise UsageError(
                f"--kv-dtype-bytes: must be one of {', '.join(map(str, KV_DTYPE_BYTES))} "
                f"(fp8, bf16/fp16, fp32), got {self.kv_dtype_bytes}"
            )
        if self.fp8_device not in FP8_DEVICES:
            raise UsageError(
                f"--fp8-device: must be one of {', '.join(FP8_DEVICES)}, got {self.fp8_device!r}"
            )
        _positive(self.ratio, "--codec-ratio")
        _positive(self.encode_gbps, "--codec-encode-gbps")
        _positive(self.decode_gbps, "--codec-decode-gbps")

    def check(self, codec: str, option: str) -> None:
        """UsageError naming ``option`` (the flag that chose ``codec``) when ``codec``
        does not apply to this KV: fp8 of 8-bit KV, lossless of a KV width with no
        typical ratio and no ``--codec-ratio``, or an unknown name."""
        if codec not in CODECS:
            raise UsageError(f"{option}: unknown codec {codec!r}; accepted: {', '.join(CODECS)}")
        if codec == FP8 and self.kv_dtype_bytes == 1:
            raise UsageError(
                f"{option} fp8: the KV is already 8-bit (--kv-dtype-bytes 1); fp8 would not "
                "shrink it (use none or lossless)"
            )
        if codec == LOSSLESS:
            self.lossless_ratio(option)

    def lossless_ratio(self, option: str) -> float:
        """The lossless codec's mean ratio; UsageError naming ``option`` (the flag that
        chose the codec) when none is given and the KV width has no default."""
        if self.ratio is not None:
            return self.ratio
        if self.kv_dtype_bytes == 2:
            return LOSSLESS_RATIO_16BIT
        if self.kv_dtype_bytes == 4:
            return LOSSLESS_RATIO_32BIT
        raise UsageError(
            f"{option} lossless: no typical ratio for {8 * self.kv_dtype_bytes}-bit KV; "
            "give --codec-ratio (raw / encoded, e.g. from kvoffload codec-check)"
        )

    def gbps(self, codec: str) -> tuple[float, float]:
        """(encode, decode) GB/s of raw bytes of ``codec`` (not ``none``) on the CPU."""
        encode, decode = DEFAULT_GBPS[codec]
        return (self.encode_gbps or encode, self.decode_gbps or decode)

    def encoded_bytes(self, codec: str, raw_bytes: int, option: str) -> int:
        """One chunk of ``raw_bytes`` encoded with ``codec``; UsageError naming
        ``option`` for a codec that does not apply (:meth:`check`; fp8 of a chunk
        that is not whole elements)."""
        self.check(codec, option)
        if codec == NONE:
            return raw_bytes
        if codec == LOSSLESS:
            return max(1, math.ceil(raw_bytes / self.lossless_ratio(option)))
        if raw_bytes % self.kv_dtype_bytes:
            raise UsageError(
                f"{option} fp8: a chunk of {raw_bytes} B is not whole {self.kv_dtype_bytes}-byte "
                "elements (check --bytes-per-token and --kv-dtype-bytes)"
            )
        elements = raw_bytes // self.kv_dtype_bytes
        return FRAME_CHECK_BYTES + elements + SCALE_BYTES * -(-elements // FP8_RUN)

    def tier_codec(
        self, codec: str, raw_bytes: int, option: str, *, slotted: bool = False
    ) -> TierCodec:
        """``codec`` applied to chunks of ``raw_bytes`` (see :meth:`encoded_bytes`) in a
        tier keyed by chunk, or (``slotted``) in one of fixed-size slots, where a
        lossless chunk takes a slot of the raw size and its overhead."""
        encoded = self.encoded_bytes(codec, raw_bytes, option)
        if codec == LOSSLESS:
            encoded = raw_bytes + LOSSLESS_OVERHEAD if slotted else encoded + LOSSLESS_FRAME
        if codec == NONE:
            return TierCodec.raw(raw_bytes)
        encode, decode = self.gbps(codec)
        gpu = codec == FP8 and self.fp8_device == "gpu"
        return TierCodec(codec, raw_bytes, encoded, 1 / (encode * 1e9), 1 / (decode * 1e9), gpu)
