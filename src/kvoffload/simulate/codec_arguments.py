"""The codec arguments of ``kvoffload simulate``: ``--codec`` and its per-tier
overrides (``--<tier>-codec``, one per tier of the registry), the KV's width, where
fp8 codes, the lossless ratio and the CPU's coding speeds; and what they build (each tier's codec
name and the :class:`~kvoffload.simulate.codecs.CodecModel`).

Bad values raise :class:`~kvoffload.core.errors.UsageError` naming the option.
"""

from __future__ import annotations

import argparse

from kvoffload.codecs import CODECS
from kvoffload.simulate.codecs import (
    DEFAULT_GBPS,
    FP8,
    FP8_DEVICES,
    KV_DTYPE_BYTES,
    LOSSLESS,
    LOSSLESS_RATIO_16BIT,
    LOSSLESS_RATIO_32BIT,
    NONE,
    CodecModel,
)
from kvoffload.tiers.registry import TIERS

_MODEL = CodecModel()


def _speeds(index: int) -> str:
    return ", ".join(f"{codec} {DEFAULT_GBPS[codec][index]:g}" for codec in (FP8, LOSSLESS))


def add_codec_arguments(kvoffload: argparse._ArgumentGroup, cost: argparse._ArgumentGroup) -> None:
    """Declare the codec arguments: the codecs and the KV's shape in the ``kvoffload``
    group, the coding speeds in the ``cost`` model's."""
    kvoffload.add_argument(
        "--codec",
        default=NONE,
        choices=CODECS,
        help="every tier's chunk codec: none (default) | lossless (bit-exact, mean ratio "
        "--codec-ratio) | fp8 (e4m3 + fp32 scales, lossy); a tier holds and moves "
        "encoded chunks",
    )
    for spec in TIERS:
        kvoffload.add_argument(
            f"--{spec.name}-codec",
            choices=CODECS,
            help=f"the {spec.name} tier's codec (default: --codec)",
        )
    kvoffload.add_argument(
        "--kv-dtype-bytes",
        type=int,
        default=_MODEL.kv_dtype_bytes,
        choices=KV_DTYPE_BYTES,
        help="bytes per KV element: 2 (bf16/fp16, default), 4 (fp32), 1 (fp8 KV: no fp8 codec)",
    )
    kvoffload.add_argument(
        "--fp8-device",
        default=_MODEL.fp8_device,
        choices=FP8_DEVICES,
        help="where fp8 codes chunks moving between the engine and a tier: gpu (default: "
        "before the copy to host, taken as free; the copy moves fp8) | cpu (the copy "
        "threads, at --codec-encode/decode-gbps; the copy moves raw KV)",
    )
    kvoffload.add_argument(
        "--codec-ratio",
        type=float,
        metavar="R",
        help="the lossless codec's mean ratio, raw / encoded bytes, in a tier keyed by "
        f"chunk (defaults measured on the demo model's KV: 16-bit {LOSSLESS_RATIO_16BIT:g}, "
        f"32-bit {LOSSLESS_RATIO_32BIT:g}; 8-bit: required); slotted tiers keep lossless "
        "chunks in raw-size slots",
    )
    cost.add_argument(
        "--codec-encode-gbps",
        type=float,
        metavar="GBPS",
        help=f"codec encode speed on the CPU, GB/s of raw KV per engine (default {_speeds(0)})",
    )
    cost.add_argument(
        "--codec-decode-gbps",
        type=float,
        metavar="GBPS",
        help=f"codec decode speed on the CPU, GB/s of raw KV per engine (default {_speeds(1)})",
    )


def codecs_of(args: argparse.Namespace) -> tuple[dict[str, str], CodecModel]:
    """Each tier's codec (its ``--<tier>-codec``, else ``--codec``) and the codec
    model. UsageError naming ``--codec`` when a tier that takes it cannot use it (fp8
    of 8-bit KV); SimConfig checks the per-tier flags."""
    model = CodecModel(
        kv_dtype_bytes=args.kv_dtype_bytes,
        fp8_device=args.fp8_device,
        ratio=args.codec_ratio,
        encode_gbps=args.codec_encode_gbps,
        decode_gbps=args.codec_decode_gbps,
    )
    given = {spec.name: getattr(args, f"{spec.name}_codec") for spec in TIERS}
    if any(codec is None for codec in given.values()):
        model.check(args.codec, "--codec")
    codecs = {name: codec if codec is not None else args.codec for name, codec in given.items()}
    return codecs, model
