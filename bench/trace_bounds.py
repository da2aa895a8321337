"""How far online signals can go: hit-rate bounds for policies that see only a chunk's
age and a few features, on a trace (docs/decisions/0014-slru.md, "How far online
signals can go").

    nice -n 19 python bench/trace_bounds.py --admission  # the shared Mooncake trace, 5/10%
    nice -n 19 python bench/trace_bounds.py --fine --clock seconds --no-held-out
    python bench/trace_bounds.py --head 3000 --shares 5   # a quick look

Model: the offline optimum's (:mod:`kvoffload.simulate.optimum`): requests in
arrival order, a request hits the leading chunks present, then all the full chunks it
computed (its prompt's, and those its output completes) are candidates at once. Every
*reference* of a chunk (each request that contains or computes it) opens an interval
that ends at the chunk's next reference (a hit there, worth that chunk's prompt
tokens under the last-token cap) or at the end of the trace. The *class* of an
interval is the tuple of features seen at its start (below), all computed from the
past only.

**Relaxed bound** (per feature set): the best hit rate of any rule that keeps a chunk
of class ``c`` for ``A_c`` steps after each reference (``A_c = 0``: not admitted;
randomized rules included), chosen with hindsight per class, when the capacity binds
only on average: the chunks resident after each request, summed over the trace, are
at most ``(host + engine chunks) x requests`` (``--clock seconds``: resident chunk-
seconds at most capacity x the trace's duration, ages in seconds). It is a linear
program: each class's (occupancy, hits) curve over ``A`` is replaced by its upper
concave hull, and the hull segments of all classes are taken steepest first until
the capacity is spent (a fractional knapsack, exact for the program). Counting every
chunk hit, not only prefix hits, only raises it. No rule that decides from these
classes and the age (and otherwise from nothing tied to the chunk's next reference:
the load, other chunks, a coin) can beat it in this model, whatever it learns.

**Held out**: the hindsight choice of ``A_c`` fits small classes to their own future.
Here the program is solved on one half's intervals and its order (which class to keep
up to which age first) applied to the other half's, until that half's average
capacity is spent: what those classes are worth to a rule that must learn them.
Both ways round (learning on the second half and scoring the first is not causal,
but it is as much a test of generalization).

**Class oracle, admission only** (``--admission``): the host-only replay of LRU (the
simulator's to within 0.05 points on the shared trace) storing only the classes whose
true future reuse rate is at least a threshold, for up to 40 thresholds (every subset
when a set has at most 7 classes); the best is printed.
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from itertools import combinations, pairwise
from pathlib import Path

from kvoffload.core.errors import KvOffloadError
from kvoffload.simulate.mooncake import MOONCAKE
from kvoffload.simulate.optimum import References, bounds, chunk_references
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.trace import TraceFile

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake-conversation.jsonl"

# Features of an interval, in the order of Rows.features; graded ones in the buckets
# of Buckets (the default's named here; --fine: FINE's).
FEATURES = (
    "output",  # the chunk was completed by a request's output (never a prompt chunk yet)
    "reuse",  # earlier references of the chunk: 0 .. 5+
    "prevgap",  # requests since its previous reference: none, <8, <32, <128, <512, <2048, more
    "engine",  # in the engine's prefix cache (an LRU of the engine's chunks) at this reference
    "depth",  # chunk's position in its request: 0, <4, <10, <20, <40, <80, more
    "cont",  # the request's already-seen prefix is longer than one chunk (a continued chat)
    "inlen",  # prompt chunks: <8, <16, <32, <64, more
    "outlen",  # output tokens: <100, <300, <600, more
    "nnew",  # chunks of the request never seen before: 0, <4, <10, <20, more
    "place",  # place among those new chunks: not new, first, 2nd-4th, later
    "period",  # which tenth of the trace (by request): a rule that changes over time
    "oracle",  # calibration only: the chunk will be referenced again
)
COARSE = ("output", "reuse", "prevgap", "engine", "depth", "cont")
SHAPE = ("output", "reuse", "inlen", "outlen", "nnew", "place")
SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("output",),
    ("output", "reuse"),
    *(("output", "reuse", f) for f in FEATURES[2:10]),
    COARSE,
    SHAPE,
    ("output", "reuse", "inlen", "outlen", "nnew", "place", "cont"),
    FEATURES[:10],
    ("output", "reuse", "period"),
    ("output", "reuse", "prevgap", "depth", "cont", "period"),
    ("oracle",),
)
HELD_OUT = ((), ("output", "reuse"), COARSE, ("output", "reuse", "inlen", "outlen"), SHAPE)


@dataclass(frozen=True)
class Buckets:
    """Right-open bucket edges of the graded features, and the reuse count's cap."""

    reuse: int = 5
    prevgap: tuple[int, ...] = (8, 32, 128, 512, 2048)
    depth: tuple[int, ...] = (1, 4, 10, 20, 40, 80)
    cont: tuple[int, ...] = (2,)  # already-seen prefix, in chunks
    inlen: tuple[int, ...] = (8, 16, 32, 64)
    outlen: tuple[int, ...] = (100, 300, 600)
    nnew: tuple[int, ...] = (1, 4, 10, 20)


# --fine: about twice the resolution of every graded feature
FINE = Buckets(
    reuse=12,
    prevgap=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    depth=(1, 2, 4, 7, 10, 15, 20, 30, 40, 60, 80, 120),
    cont=(1, 2, 3, 4, 6, 10),
    inlen=(4, 8, 12, 16, 24, 32, 48, 64, 96),
    outlen=(50, 100, 200, 300, 450, 600, 1000),
    nnew=(1, 2, 4, 7, 10, 15, 20, 30),
)


def bucket(x: int, edges: Sequence[int]) -> int:
    return bisect.bisect_right(edges, x)


@dataclass
class Rows:
    """One entry per reference, in replay order (each request's prompt chunks, then
    its output's): the request index, the next use (request index, -1: none), the
    tokens that next use would be served, and the features; ``times``: each
    request's arrival (seconds)."""

    times: list[float]
    start: list[int]
    next_use: list[int]
    weight: list[int]
    features: list[tuple[int, ...]]


def build_rows(
    refs: References,
    times: list[float],
    outputs: list[int],
    engine: int,
    edges: Buckets = Buckets(),
) -> Rows:
    """The intervals of ``refs`` (see the module docstring); ``engine``: the engine's
    prefix cache in chunks."""
    rows = Rows(times, [], [], [], [])
    last: dict[int, int] = {}
    count: dict[int, int] = defaultdict(int)
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    size = refs.chunk_tokens
    for i, row in enumerate(refs.chunks):
        cap = (refs.prompts[i] - 1) // refs.block_size * refs.block_size
        known = 0
        while known < len(row) and row[known] in seen:
            known += 1
        new = len(row) - known
        shape = (
            bucket(known, edges.cont),
            bucket(len(row), edges.inlen),
            bucket(outputs[i], edges.outlen),
            bucket(new, edges.nnew),
        )
        for pos, c in enumerate((*row, *refs.outputs[i])):
            is_output = pos >= len(row)
            j = last.get(c)
            gap = -1
            if j is not None:
                rows.next_use[j] = i
                rows.weight[j] = (
                    0 if is_output else min((pos + 1) * size, cap) - min(pos * size, cap)
                )
                gap = i - rows.start[j]
            in_engine = c in lru
            lru[c] = None
            lru.move_to_end(c)
            if len(lru) > engine:
                lru.popitem(last=False)
            last[c] = len(rows.start)
            rows.start.append(i)
            rows.next_use.append(-1)
            rows.weight.append(0)
            place = 0 if pos < known else bucket(pos - known, (1, 4)) + 1
            rows.features.append(
                (
                    int(is_output and count[c] == 0),
                    min(count[c], edges.reuse),
                    0 if gap < 0 else bucket(gap, edges.prevgap) + 1,
                    int(in_engine),
                    bucket(pos, edges.depth),
                    *shape,
                    place,
                    i * 10 // len(refs.chunks),
                    0,
                )
            )
            count[c] += 1
        seen.update(row)
    rows.features = [
        (*f[:-1], int(n >= 0)) for f, n in zip(rows.features, rows.next_use, strict=True)
    ]
    return rows


Spans = dict[tuple[int, ...], list[tuple[float, int]]]  # class -> sorted (length, hit tokens)
Curve = list[tuple[float, float, float]]  # (threshold A, occupancy, hit tokens), A ascending


def class_spans(
    rows: Rows,
    keep: Callable[[int], bool],
    key: Callable[[tuple[int, ...]], tuple[int, ...]],
    clock: str,
) -> Spans:
    """Per class, its intervals' (length, tokens served at their end): length in
    requests (``steps``) or seconds, to the next use or the end of the trace (0
    tokens). Only rows ``r`` with ``keep(r)``."""
    end_i = len(rows.times)
    end_t = rows.times[-1]
    spans: Spans = defaultdict(list)
    for r in range(len(rows.start)):
        if not keep(r):
            continue
        n, i = rows.next_use[r], rows.start[r]
        if clock == "steps":
            length = float((n if n >= 0 else end_i) - i)
        else:
            length = (rows.times[n] if n >= 0 else end_t) - rows.times[i]
        spans[key(rows.features[r])].append((length, rows.weight[r] if n >= 0 else 0))
    for items in spans.values():
        items.sort()
    return spans


def curve(items: list[tuple[float, int]]) -> Curve:
    """(A, occupancy, hits) of keeping for A after each reference, at A = 0 and every
    interval length (the vertices: between them hits stay, occupancy grows)."""
    out: Curve = [(0.0, 0.0, 0.0)]
    done_len = done_hit = 0.0
    m = len(items)
    for k, (length, hit) in enumerate(items):
        done_len += length
        done_hit += hit
        if k + 1 < m and items[k + 1][0] == length:
            continue
        out.append((length, done_len + length * (m - k - 1), done_hit))
    return out


def hull(points: Curve) -> Curve:
    """The upper concave hull of a curve's (occupancy, hits) points, from (0, 0)."""
    out: Curve = []
    for p in points:
        while len(out) >= 2:
            (_, x1, y1), (_, x2, y2) = out[-2], out[-1]
            if (y2 - y1) * (p[1] - x1) <= (p[2] - y1) * (x2 - x1):
                out.pop()
            else:
                break
        out.append(p)
    return out


def relaxed_bound(spans: Spans, capacity: float) -> float:
    """The linear program's value (module docstring): hull segments steepest first
    until ``capacity`` (chunk-requests or chunk-seconds) is spent."""
    segments: list[tuple[float, float, float]] = []  # (slope, occupancy, hits)
    for items in spans.values():
        h = hull(curve(items))
        for (_, x1, y1), (_, x2, y2) in pairwise(h):
            if y2 > y1:
                segments.append(
                    ((y2 - y1) / (x2 - x1) if x2 > x1 else float("inf"), x2 - x1, y2 - y1)
                )
    segments.sort(reverse=True)
    total = 0.0
    for slope, dx, dy in segments:
        if dx > capacity:
            return total + slope * capacity
        capacity -= dx
        total += dy
    return total


def held_out(
    rows: Rows,
    key: Callable[[tuple[int, ...]], tuple[int, ...]],
    chunks: int,
    clock: str,
    learn_first: bool = True,
) -> float:
    """Hit tokens of one half's intervals when the other half's program picks the
    order (``learn_first``: learned on the first half, scored on the second; else the
    reverse): its hull segments (a class, from one A to the next) are taken in the
    learning half's slope order, each worth what it holds and costs on the scored
    half, until ``chunks`` on average over the scored half are spent (the last one in
    part: a randomized rule). Classes the learning half never saw are not stored."""
    half = len(rows.times) // 2
    first = class_spans(rows, lambda r: rows.start[r] < half, key, clock)
    second = class_spans(rows, lambda r: rows.start[r] >= half, key, clock)
    train, test = (first, second) if learn_first else (second, first)
    lo, hi = (half, len(rows.times)) if learn_first else (0, half)
    if clock == "steps":
        budget = chunks * float(hi - lo)
    else:
        budget = chunks * (rows.times[hi - 1] - rows.times[lo])
    order: list[tuple[float, tuple[int, ...], float, float]] = []  # (slope, class, A from, A to)
    for cls, items in train.items():
        h = hull(curve(items))
        for (a1, x1, y1), (a2, x2, y2) in pairwise(h):
            if y2 > y1:
                order.append(((y2 - y1) / (x2 - x1) if x2 > x1 else float("inf"), cls, a1, a2))
    order.sort(key=lambda o: -o[0])
    sums: dict[tuple[int, ...], tuple[list[float], list[float], list[float]]] = {}
    for cls, items in test.items():
        pre_len, pre_hit = [0.0], [0.0]
        for length, hit in items:
            pre_len.append(pre_len[-1] + length)
            pre_hit.append(pre_hit[-1] + hit)
        sums[cls] = ([length for length, _ in items], pre_len, pre_hit)

    def at(cls: tuple[int, ...], a: float) -> tuple[float, float]:
        lengths, pre_len, pre_hit = sums[cls]
        k = bisect.bisect_right(lengths, a)
        return pre_len[k] + a * (len(lengths) - k), pre_hit[k]

    hits = 0.0
    for _, cls, a1, a2 in order:
        if cls not in sums:
            continue
        (x1, y1), (x2, y2) = at(cls, a1), at(cls, a2)
        if x2 - x1 > budget:
            return hits + (y2 - y1) * budget / (x2 - x1)
        budget -= x2 - x1
        hits += y2 - y1
    return hits


def lru_replay(
    refs: References,
    capacity: int,
    admit: Callable[[int], bool],
    window: tuple[int, int] = (0, 1 << 62),
) -> int:
    """Prompt tokens served by a host-only LRU of ``capacity`` chunks that stores a
    missing chunk only if ``admit(row)`` (rows numbered as in :func:`build_rows`), to
    the requests whose index is in ``window`` (the cache runs from the start)."""
    cache: OrderedDict[int, None] = OrderedDict()
    served = r = 0
    size = refs.chunk_tokens
    for i, row in enumerate(refs.chunks):
        k = 0
        while k < len(row) and row[k] in cache:
            k += 1
        if window[0] <= i < window[1]:
            served += min(k * size, (refs.prompts[i] - 1) // refs.block_size * refs.block_size)
        for c in (*row, *refs.outputs[i]):
            if c in cache:
                cache.move_to_end(c)
            elif admit(r):
                cache[c] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
            r += 1
    return served


def infinite_in(refs: References, window: tuple[int, int]) -> int:
    """Prompt tokens an infinite cache serves to the requests in ``window``."""
    seen: set[int] = set()
    served = 0
    for i, row in enumerate(refs.chunks):
        k = 0
        while k < len(row) and row[k] in seen:
            k += 1
        if window[0] <= i < window[1]:
            served += min(
                k * refs.chunk_tokens, (refs.prompts[i] - 1) // refs.block_size * refs.block_size
            )
        seen.update(row)
        seen.update(refs.outputs[i])
    return served


def admission_oracle(rows: Rows, refs: References, capacity: int, names: tuple[str, ...]) -> int:
    """The best LRU replay over admission sets of ``names``' classes: every subset
    when there are at most 7 classes, else the classes with the highest true future
    reuse rate, for every threshold (at most 40, evenly spaced)."""
    key = selector(names)
    classes = [key(f) for f in rows.features]
    reused: dict[tuple[int, ...], list[int]] = defaultdict(lambda: [0, 0])
    for cls, n in zip(classes, rows.next_use, strict=True):
        reused[cls][0] += 1
        reused[cls][1] += n >= 0
    ranked = sorted(reused, key=lambda c: -reused[c][1] / reused[c][0])
    if len(ranked) <= 7:
        choices = [set(s) for n in range(len(ranked) + 1) for s in combinations(ranked, n)]
    else:
        step = max(1, len(ranked) // 40)
        choices = [set(ranked[:j]) for j in range(0, len(ranked) + 1, step)] + [set(ranked)]
    best = 0
    for chosen in choices:
        best = max(best, lru_replay(refs, capacity, lambda r, c=chosen: classes[r] in c))  # type: ignore[misc]
    return best


def selector(names: tuple[str, ...]) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    where = [FEATURES.index(n) for n in names]
    return lambda f: tuple(f[i] for i in where)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(SHARED_TRACE), help="a trace (default: the shared one)")
    p.add_argument("--head", type=int, help="only the first N requests")
    p.add_argument("--shares", default="5,10", help="host capacities, %% of distinct chunks")
    p.add_argument("--chunk-tokens", type=int, help="default: a Mooncake trace's block, or 256")
    p.add_argument(
        "--engine-chunks", type=int, help="engine prefix cache (default: the simulator's)"
    )
    p.add_argument("--clock", choices=("steps", "seconds"), default="steps", help="age unit")
    p.add_argument("--fine", action="store_true", help="finer buckets (see FINE)")
    p.add_argument("--no-held-out", action="store_true", help="skip the held-out table")
    p.add_argument("--admission", action="store_true", help="also the class oracle (slow)")
    return p.parse_args(argv)


def label(names: tuple[str, ...]) -> str:
    return "+".join(names) if names else "(age only)"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    workload = TraceFile(args.trace, args.head)
    requests = list(workload.requests())
    chunk_tokens = args.chunk_tokens or (
        workload.block_tokens if workload.format == MOONCAKE else SimConfig(0).chunk_tokens
    )
    base = SimConfig(cpu_bytes=0, chunk_tokens=chunk_tokens)
    engine = (
        base.engine_tokens // chunk_tokens if args.engine_chunks is None else args.engine_chunks
    )
    refs = chunk_references(requests, chunk_tokens, base.block_size)
    edges = FINE if args.fine else Buckets()
    rows = build_rows(refs, [r.t for r in requests], [r.output for r in requests], engine, edges)
    shares = [Decimal(s) for s in args.shares.split(",") if s.strip()]
    capacity = {s: int(s * refs.distinct / 100) for s in shares}
    total = refs.prompt_tokens
    print(
        f"{workload.describe()}: {len(requests)} requests, {refs.distinct} distinct chunks of "
        f"{chunk_tokens} tokens, {len(rows.start)} references; engine {engine} chunks; "
        f"clock: {args.clock}; buckets: {'fine' if args.fine else 'coarse'}"
    )
    head = f"{'':62}" + "".join(f"{f'{s}% ({capacity[s]})':>16}" for s in shares)
    print("\nreplays and limits (prompt tokens served / prompt tokens)\n" + head)
    rates: dict[str, list[float]] = {
        "optimum (Belady with bypass, kvoffload.simulate.optimum)": [
            bounds(refs, capacity[s]).optimum_rate for s in shares
        ],
        "lru (host-only replay)": [
            lru_replay(refs, capacity[s], lambda r: True) / total for s in shares
        ],
        "lru storing only chunks that will be read again (per-chunk oracle)": [
            lru_replay(refs, capacity[s], lambda r: rows.next_use[r] >= 0) / total for s in shares
        ],
    }
    for name, values in rates.items():
        print(f"{name[:62]:62}" + "".join(f"{v:16.2%}" for v in values))
    units = {s: float(capacity[s] + engine) for s in shares}
    steps = float(len(rows.times)) if args.clock == "steps" else rows.times[-1] - rows.times[0]
    print("\nrelaxed bound: any keep-for-A_c rule by class, A_c in hindsight, capacity on average")
    print(f"{'features':52}{'classes':>10}" + head[62:])
    for names in SETS:
        spans = class_spans(rows, lambda r: True, selector(names), args.clock)
        values = [relaxed_bound(spans, units[s] * steps) / total for s in shares]
        print(
            f"{label(names)[:51]:52}{len(spans):>10}" + "".join(f"{v:16.2%}" for v in values),
            flush=True,
        )
    if not args.no_held_out:
        half = len(rows.times) // 2
        for learn_first in (True, False):
            window = (half, len(rows.times)) if learn_first else (0, half)
            scored = sum(refs.prompts[window[0] : window[1]])
            lru = [lru_replay(refs, capacity[s], lambda r: True, window) / scored for s in shares]
            top = infinite_in(refs, window) / scored
            print(
                "\nheld out: A_c chosen on the "
                + (
                    "first half, applied to the second"
                    if learn_first
                    else "second half, applied to the first"
                )
                + " (its prompt tokens); in brackets the share of LRU's gap to an infinite "
                "cache closed"
            )
            print(f"{'features':62}" + head[62:])
            print(f"{'lru (host-only replay)':62}" + "".join(f"{v:16.2%}" for v in lru))
            print(f"{'infinite cache':62}" + "".join(f"{top:16.2%}" for _ in shares))
            for names in HELD_OUT:
                values = [
                    held_out(rows, selector(names), capacity[s] + engine, args.clock, learn_first)
                    / scored
                    for s in shares
                ]
                cells = "".join(
                    f"{f'{v:.2%} ({(v - b) / (top - b):.0%})' if top > b else f'{v:.2%}':>16}"
                    for v, b in zip(values, lru, strict=True)
                )
                print(f"{label(names)[:62]:62}" + cells, flush=True)
    if args.admission:
        print("\nclass oracle, admission only: LRU storing the best set of classes (replay)")
        print(f"{'features':62}" + head[62:])
        for names in (("output", "reuse"), COARSE, SHAPE):
            values = [admission_oracle(rows, refs, capacity[s], names) / total for s in shares]
            print(f"{label(names)[:62]:62}" + "".join(f"{v:16.2%}" for v in values), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KvOffloadError as exc:
        sys.exit(f"bench/trace_bounds.py: error: {exc}")
