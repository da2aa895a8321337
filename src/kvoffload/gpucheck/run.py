"""The command line of ``scripts/gpu-check`` (``python -m kvoffload.gpucheck``).

    scripts/gpu-check [--dry-run] [--quick] [--budget-s 540]

Parts, in order, each given a share of the time budget:

1. ``correctness:cpu``: the round trips of :mod:`.correctness` on the CPU copy path,
   over a private slab and over a node-shared slab mapped without registration;
2. ``codec:cpu``: :mod:`.codec`, the fp8 codec's round trips and speed against plain
   copies, on the CPU copy path;
3. ``correctness:cuda``: the round trips on the GPU (CUDA copier, page-locked slab,
   shared slab registered with ``cudaHostRegister``), for more block sizes;
4. ``codec:cuda``: :mod:`.codec` on the GPU (fp8 encoded and decoded on the device);
5. ``throughput``: :mod:`.throughput`, every chunk size, both directions;
6. ``overlap``: :mod:`.overlap`.

``--dry-run`` (or no GPU) runs parts 1 and 2 only; the others are listed in ``skipped``
(without ``--dry-run`` and without a GPU that is also an error). ``--quick`` runs fewer
cases, rounds and bytes. A part that raises is recorded in ``errors`` and the next
part runs; SIGTERM or SIGINT stops the check at once, still printing the JSON line.
Human lines go to stderr, the JSON line (:mod:`.report`) last to stdout. Exit status:
0 when everything that ran passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Sequence
from types import FrameType

import torch

from kvoffload.gpucheck import codec, correctness, overlap, throughput
from kvoffload.gpucheck.report import Budget, Report

CUDA_PARTS = ("correctness:cuda", "codec:cuda", "throughput", "overlap")


class Interrupted(BaseException):
    """A signal asked the check to stop (not an :class:`Exception`: no part's
    per-case handler swallows it)."""


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu-check",
        description="Check kvoffload's CUDA copies: correctness, throughput, overlap.",
    )
    parser.add_argument("--dry-run", action="store_true", help="no GPU: run the CPU checks only")
    parser.add_argument("--quick", action="store_true", help="fewer cases, rounds and bytes")
    parser.add_argument(
        "--budget-s", type=float, default=540.0, help="wall-clock budget in seconds (540)"
    )
    return parser.parse_args(argv)


def _on_signals() -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(f"stopped by signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def _part(report: Report, name: str, body: Callable[[], None]) -> None:
    try:
        body()
    except Exception as exc:
        report.error(name, exc)


def _cuda_parts(report: Report, quick: bool, total: Budget) -> list[tuple[str, Callable[[], None]]]:
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = (16,) if quick else (16, 32, 128)
    tp_config = (
        throughput.ThroughputConfig(round_bytes=32 << 20, rounds=3)
        if quick
        else throughput.ThroughputConfig()
    )
    ov_config = (
        overlap.OverlapConfig(target_s=0.3, rounds=1, engine_bytes=256 << 20)
        if quick
        else overlap.OverlapConfig()
    )

    def run_overlap() -> None:
        entry = overlap.run(device, ov_config, total.share(1.0))
        report.overlap = entry
        report.say(
            f"overlap: matmul {entry['matmul_alone_s']:.3f} s alone, "
            f"{entry['matmul_with_copies_s']:.3f} s with copies (slowdown "
            f"{entry['slowdown']:.3f}); copies {entry['copy_alone_gbps']:.2f} GB/s alone, "
            f"{entry['copy_during_gbps']:.2f} GB/s during the matmul"
        )

    return [
        ("correctness:cuda", lambda: correctness.run_all(report, device, sizes, total.share(0.25))),
        ("codec:cuda", lambda: codec.run_all(report, device, total.share(0.1), chunks=32)),
        ("throughput", lambda: throughput.run_all(report, device, tp_config, total.share(0.7, 60))),
        ("overlap", run_overlap),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check (module doc); print the JSON line; the exit status."""
    args = _parse(argv)
    report = Report(dry_run=args.dry_run)
    total = Budget.of(args.budget_s)
    cuda = torch.cuda.is_available()
    pending = ["correctness:cpu", *CUDA_PARTS]
    try:
        _on_signals()
        report.say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU available: {cuda}")
        cpu_sizes = (16,) if args.quick or not args.dry_run else (16, 32)
        cpu = torch.device("cpu")
        _part(
            report,
            "correctness:cpu",
            lambda: correctness.run_all(report, cpu, cpu_sizes, total.share(0.15)),
        )
        pending.pop(0)
        _part(report, "codec:cpu", lambda: codec.run_all(report, cpu, total.share(0.05), chunks=4))
        if args.dry_run or not cuda:
            why = "dry run: needs a CUDA GPU" if args.dry_run else "no CUDA GPU"
            if not args.dry_run:
                report.errors.append(
                    "no CUDA GPU: torch.cuda.is_available() is false (use --dry-run)"
                )
            for part in CUDA_PARTS:
                report.skip(part, why)
            pending.clear()
        else:
            report.device = torch.cuda.get_device_name()
            report.say(f"device: {report.device}")
            for name, body in _cuda_parts(report, args.quick, total):
                _part(report, name, body)
                pending.pop(0)
    except Interrupted as exc:
        report.errors.append(f"interrupted: {exc}")
        for part in pending:
            report.skip(part, "interrupted")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    failures, errors = len(report.failed_correctness), len(report.errors)
    verdict = "PASSED" if report.ok else "FAILED"
    report.say(f"{verdict}: {failures} correctness failures, {errors} errors")
    print(report.as_json(), flush=True)
    return report.exit_code()
