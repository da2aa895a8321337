"""What the weights digest costs an engine's start (issue 41, item 5), against an
engine without kvoffload measured in the same run.

Two parts, every measurement in a fresh process (nothing remembered in memory):

- **Digest step** (``core/identity/model.py`` ``weights_digest``) on the ``--preset``
  checkpoint copied beside what a Hub repository or a training run often ships with it
  (``pytorch_model.bin`` and ``tf_model.h5`` of the weights' size, ``optimizer.pt``
  twice that, ``training_args.bin``): the files vLLM's loader reads (what kvoffload
  digests now) against every file with a weight suffix (what it digested before),
  with the digest cache empty and the page cache dropped (*cold*), the cache empty
  and the files in the page cache (*warm disk*), and the digests remembered.
- **Engine start** (``vllm.LLM(...)`` built in-process, scheduler half and worker in
  one process) on the plain checkpoint, without kvoffload and with it (host tier
  only), in the same three states: the time to build the engine, the time spent in
  kvoffload's ``weights_digest`` calls, the bytes they read, and the ratio of the
  start with kvoffload to the start without.

*Cold* drops the page cache (``echo 3 > /proc/sys/vm/drop_caches``) when this process
may; otherwise only the digest cache is cold and the output says so. Run under the
heavy lock: ``flock /tmp/kvo-heavy.lock .venv/bin/python bench/identity_startup.py
[--preset demo] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARK = "RESULT "
DROP = Path("/proc/sys/vm/drop_caches")
EXTRAS = {"pytorch_model.bin": 1.0, "tf_model.h5": 1.0, "optimizer.pt": 2.0}
"""Files written beside the weights, each this many times the weights' size."""
STATES = ("cold", "warm-disk", "remembered")


def drop_page_cache() -> bool:
    """Drop the page cache; whether this process could."""
    try:
        os.sync()
        DROP.write_text("3\n")
    except OSError:
        return False
    return True


def with_extras(model: Path, root: Path) -> Path:
    """A copy of ``model`` (hard links where possible) with :data:`EXTRAS` beside it."""
    target = root / f"{model.name}-with-extras"
    target.mkdir()
    weights = 0
    for f in model.iterdir():
        if f.is_file():
            try:
                os.link(f, target / f.name)
            except OSError:
                shutil.copy2(f, target / f.name)
            if f.suffix == ".safetensors":
                weights += f.stat().st_size
    chunk = os.urandom(1 << 24)
    for name, factor in EXTRAS.items():
        left = int(weights * factor)
        with open(target / name, "wb") as out:
            while left > 0:
                left -= out.write(chunk[: min(left, len(chunk))])
    (target / "training_args.bin").write_bytes(os.urandom(5000))
    return target


# --- the child processes --------------------------------------------------------------


def child_digest(model: Path, selection: str) -> dict[str, Any]:
    """Digest ``model``'s files as kvoffload does now (``loaded``) or did before
    (``suffix``: every file with a weight suffix, the choice kept for load formats it
    does not model)."""
    from kvoffload.core.identity import content_digest
    from kvoffload.core.identity.model import weights_digest

    read = count_reads(content_digest)
    load_format = "auto" if selection == "loaded" else "dummy"
    start = time.perf_counter()
    weights_digest(model, load_format=load_format)
    return {"seconds": time.perf_counter() - start, "bytes": sum(read)}


def child_engine(model: Path, preset: str, offload: bool) -> dict[str, Any]:
    """Build the engine once (kvoffload's connector or none); its build time and the
    time and bytes of kvoffload's weights digest."""
    from kvoffload.adapters.vllm import identity
    from kvoffload.core.identity import content_digest
    from kvoffload.demos.chat_demo import kvoffload_config
    from kvoffload.demos.tiny_model import kv_bytes_per_token
    from kvoffload.demos.vllm_runner import EngineSpec, open_engine

    read = count_reads(content_digest)
    spent: list[float] = []
    real = identity.weights_digest

    def timed(vllm_config: Any) -> str:
        start = time.perf_counter()
        try:
            return real(vllm_config)
        finally:
            spent.append(time.perf_counter() - start)

    identity.weights_digest = timed  # type: ignore[assignment]
    spec = EngineSpec(
        model=model,
        kv_cache_memory_bytes=4096 * kv_bytes_per_token(preset),
        max_model_len=2048,
        kv_transfer_config=kvoffload_config(256 << 20) if offload else None,
    )
    start = time.perf_counter()
    with open_engine(spec):
        built = time.perf_counter() - start
    return {"seconds": built, "digest_s": sum(spent), "calls": len(spent), "bytes": sum(read)}


def count_reads(content_digest: Any) -> list[int]:
    """Wrap ``hash_file`` (every full read of a file): the sizes it read."""
    sizes: list[int] = []
    real = content_digest.hash_file

    def counted(path: Path) -> str:
        sizes.append(os.stat(path).st_size)
        return real(path)

    content_digest.hash_file = counted
    return sizes


# --- the parent -----------------------------------------------------------------------


def run_child(args: list[str], cache: Path, log: Path) -> dict[str, Any]:
    env = {**os.environ, "KVOFFLOAD_CACHE_DIR": str(cache)}
    with log.open("a") as out:
        done = subprocess.run(
            [sys.executable, __file__, "--child", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            check=False,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"child {args} failed (rc {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len(MARK) :])
    return result


@dataclass(frozen=True)
class Bench:
    root: Path  # the run's folder: cache folders, the copy with extras, the log
    log: Path  # what the children wrote to stderr
    can_drop: bool  # this process may drop the page cache

    def measure(self, args: list[str], state: str, rep: int) -> dict[str, Any]:
        """One child run in cache ``state`` (a cache folder of its own per kind and
        rep, kept from the previous state for ``remembered``)."""
        cache = self.root / f"cache-{'-'.join(args[:1] + args[2:])}-{rep}"
        if state != "remembered":
            shutil.rmtree(cache, ignore_errors=True)
        if state == "cold" and self.can_drop:
            drop_page_cache()
        return run_child(args, cache, self.log)


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", nargs="+")
    options = parser.parse_args()
    if options.child:
        kind, model, *rest = options.child
        if kind == "digest":
            result = child_digest(Path(model), rest[0])
        else:
            result = child_engine(Path(model), rest[0], rest[1] == "kvoffload")
        print(MARK + json.dumps(result), flush=True)
        return

    from kvoffload.demos.tiny_model import ensure_model

    model = ensure_model(options.preset)
    can_drop = drop_page_cache()
    cold = "page cache dropped" if can_drop else "ONLY the digest cache was cold (no drop)"
    root = Path(tempfile.mkdtemp(prefix="kvo-identity-startup-"))
    bench = Bench(root, root / "children.log", can_drop)
    try:
        extras = with_extras(model, root)
        print(f"model {model} ({options.preset}); cold: {cold}; {options.reps} reps, medians")
        print("\n## digest step, checkpoint with files beside the weights")
        for state in STATES:
            row = {}
            for selection in ("loaded", "suffix"):
                args = ["digest", str(extras), selection]
                runs = [bench.measure(args, state, r) for r in range(options.reps)]
                row[selection] = (median_of(runs, "seconds"), median_of(runs, "bytes"))
            (new_s, new_b), (old_s, old_b) = row["loaded"], row["suffix"]
            print(
                f"{state:>10}: vLLM's files {new_s:7.3f} s {new_b / 1e6:8.1f} MB read | "
                f"every weight suffix {old_s:7.3f} s {old_b / 1e6:8.1f} MB | "
                f"time ratio {new_s / old_s:5.2f}"
            )
        print("\n## engine start (LLM built in-process), plain checkpoint")
        for state in STATES:
            runs_by: dict[str, list[dict[str, Any]]] = {}
            for engine in ("none", "kvoffload"):
                args = ["engine", str(model), options.preset, engine]
                runs_by[engine] = [bench.measure(args, state, r) for r in range(options.reps)]
            base = median_of(runs_by["none"], "seconds")
            kvo = runs_by["kvoffload"]
            with_kvo = median_of(kvo, "seconds")
            print(
                f"{state:>10}: without {base:6.2f} s | with kvoffload {with_kvo:6.2f} s | "
                f"ratio {with_kvo / base:5.3f} | digest {median_of(kvo, 'digest_s'):6.3f} s "
                f"in {int(median_of(kvo, 'calls'))} calls, "
                f"{median_of(kvo, 'bytes') / 1e6:6.1f} MB read"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
