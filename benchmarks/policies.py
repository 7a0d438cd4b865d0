#!/usr/bin/env python3
"""How close do the eviction policies get to the offline optimum on prefix traces?

Replays Mooncake's synthetic trace and a generated multi-turn trace (benchmarks/traces.py, seed
0) through each policy at several cache capacities (in blocks) and reports the block hit rate
and replay throughput, next to Belady's MIN.

Replay semantics (identical for every policy, Belady included), per request:
  1. hit = the longest run of the request's leading hash_ids that is resident; those
     blocks are touched as one run (`touch_run`, deepest first) and counted as hits;
  2. every later block is touched if it happens to be resident (it is reused, but is not
     a prefix hit) and inserted otherwise, as runs of consecutive blocks (`insert_run`);
  Every call carries a BlockInfo: depth, parent, the request's arrival (the trace's
  `timestamp`) and, unless --no-session-hints, its `session` (the generated trace has one;
  Mooncake's has none).
  3. before inserting, `evict(k, protected=<this request's blocks>)` frees exactly the
     room needed. A request can never evict its own blocks, so if it is bigger than what
     the others leave free, only its leading missing blocks that fit are inserted.

Priorities handed to `touch`/`insert`, one block per call (LRU and turn_lru ignore them, and
run once; --priority-modes picks which
priority variants run):
  uniform  every block 0: the priority policy must then equal LRU exactly (a check);
  depth    the block's position in its prompt (0 = first block): an online hint, since
           deep blocks of long prompts are rarely shared; ties go LRU;
  shared   0 for blocks that more than one request in the replay uses, else 10. This is
           an ORACLE hint (it knows the future), standing in for an operator who marks
           shared system prompts as high priority.

Belady (MIN) evicts the resident, unprotected block whose next use is farthest away,
deeper blocks first among ties. Under prefix-hit semantics it is a strong offline
reference, not a proven upper bound.

Throughput is block operations (touches + inserts + evicted blocks) per second of the
whole replay loop, residency lookups included. It is noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ClassVar, NamedTuple

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
# `python benchmarks/policies.py` puts benchmarks/ first on sys.path, where this very
# file would shadow the `policies` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(REPO))

from benchmarks._plots import plot_file  # noqa: E402
from benchmarks.traces import BLOCK as BLOCK_TOKENS  # noqa: E402
from benchmarks.traces import TraceSpec, generate, unbounded_hit_rate  # noqa: E402
from policies import BlockInfo, EvictionPolicy, make_policy  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
GENERATED = "multiturn"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "policies.json"
# The demo model's cold prefill in float32 on an AMD EPYC (8,000 tokens in 21.12 s, docs/performance/tier-io.md):
# what a hit token saves, for --kv-quant's seconds.
PREFILL_TOKENS_PER_S = 379.0
INF = float("inf")

Trace = list[list[int]]


class Request(NamedTuple):
    """One trace line as the replay uses it."""

    ids: list[int]
    arrival: float  # seconds
    session: str | None  # the trace's `session` field, unless --no-session-hints
PriorityFn = Callable[[int, int], int]  # (block, position in prompt) -> priority


class BeladyPolicy(EvictionPolicy[int]):
    """Offline MIN over a known trace. The replay sets `now` to the current request index;
    a block's rank is its next use after `now`. Max-heap with lazily invalidated entries."""

    name: ClassVar[str] = "belady"

    def __init__(self, trace: Trace) -> None:
        self.now = 0
        self._uses: dict[int, list[int]] = {}  # block -> request indices that use it, sorted
        self._depth: dict[int, int] = {}
        for i, ids in enumerate(trace):
            for pos, b in enumerate(ids):
                self._uses.setdefault(b, []).append(i)
                self._depth[b] = pos
        self._entry: dict[int, tuple[float, int, int, int]] = {}  # resident -> live entry
        self._heap: list[tuple[float, int, int, int]] = []  # (-next_use, -depth, seq, key)
        self._seq = itertools.count()

    def _push(self, key: int) -> None:
        uses = self._uses[key]
        j = bisect.bisect_right(uses, self.now)
        entry = (-(uses[j] if j < len(uses) else INF), -self._depth[key], next(self._seq), key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._entry) + 1024:  # drop stale entries
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def insert(self, key: int, priority: int = 0) -> None:
        if key in self._entry:
            raise ValueError(key)
        self._push(key)

    def touch(self, key: int, priority: int | None = None) -> None:
        if key not in self._entry:
            raise KeyError(key)
        self._push(key)

    def remove(self, key: int) -> None:
        del self._entry[key]

    def evict(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n < 0:
            raise ValueError(n)
        taken: list[tuple[float, int, int, int]] = []
        held: list[tuple[float, int, int, int]] = []  # protected entries, pushed back after
        while self._heap and len(taken) < n:
            entry = heapq.heappop(self._heap)
            if self._entry.get(entry[3]) is not entry:
                continue  # stale
            (held if entry[3] in protected else taken).append(entry)
        ok = len(taken) == n
        for entry in held + ([] if ok else taken):
            heapq.heappush(self._heap, entry)
        if not ok:
            return None
        for entry in taken:
            del self._entry[entry[3]]
        return [entry[3] for entry in taken]

    def pin(self, key: int) -> None:
        raise NotImplementedError("offline reference: no pins")

    def unpin(self, key: int) -> None:
        raise NotImplementedError("offline reference: no pins")

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def check_integrity(self) -> None:
        if any(e not in self._heap for e in self._entry.values()):
            raise RuntimeError("resident block without a live heap entry")


def replay(policy: EvictionPolicy, trace: list[Request], capacity: int, prio: PriorityFn) -> dict:
    """Run the replay described in the module docstring; return counters and timing. A
    request's hit prefix is one `touch_run` run and its new blocks one `insert_run` run,
    each with the run's first `BlockInfo` (depth, parent, arrival, priority, session hint),
    as a tier passes them. With per-block priorities (`depth`, `shared`) every block is its
    own call instead, deepest first, as the runs' default does."""
    hits = refs = ops = 0
    contains, touch, evict = policy.__contains__, policy.touch_block, policy.evict
    per_block = prio is not UNIFORM

    def run(method: Callable, one: Callable, keys: list[int], info: BlockInfo) -> None:
        if not per_block:
            method(keys, info)
            return
        for i in range(len(keys) - 1, -1, -1):  # deepest first, as the runs' default
            pos = info.depth + i
            one(keys[i], BlockInfo(pos, keys[i - 1] if i else info.parent, info.arrival, prio(keys[i], pos), info.session))

    is_belady = isinstance(policy, BeladyPolicy)
    t0 = time.perf_counter()
    for i, (ids, arrival, session) in enumerate(trace):
        if is_belady:
            policy.now = i
        refs += len(ids)
        h = 0
        for b in ids:
            if not contains(b):
                break
            h += 1
        if h:
            run(policy.touch_run, touch, ids[:h], BlockInfo(0, None, arrival, 0, session))
        hits += h
        missing: list[int] = []  # positions
        for pos in range(h, len(ids)):
            b = ids[pos]
            if contains(b):
                touch(b, BlockInfo(pos, ids[pos - 1] if pos else None, arrival, prio(b, pos), session))
            else:
                missing.append(pos)
        ops += len(ids) - len(missing)
        # Room left for this request once every other block could go; cache what fits.
        missing = missing[: max(0, capacity - (len(ids) - len(missing)))]
        need = len(policy) + len(missing) - capacity
        if need > 0:
            victims = evict(need, protected=set(ids))
            if victims is None:  # cannot happen: the room was computed above
                raise RuntimeError(f"{policy.name}: evict({need}) failed at request {i}")
            ops += need
        start = 0
        for j in range(1, len(missing) + 1):  # runs of consecutive missing positions
            if j == len(missing) or missing[j] != missing[j - 1] + 1:
                pos = missing[start]
                run(policy.insert_run, policy.insert_block, [ids[q] for q in missing[start:j]],
                    BlockInfo(pos, ids[pos - 1] if pos else None, arrival, 0, session))
                start = j
        ops += len(missing)
        if len(policy) > capacity:
            raise RuntimeError(f"{policy.name}: {len(policy)} blocks > capacity {capacity}")
    seconds = time.perf_counter() - t0
    return {
        "hits": hits,
        "refs": refs,
        "hit_rate": hits / refs if refs else 0.0,
        "ops": ops,
        "seconds": seconds,
        "ops_per_s": ops / seconds if seconds else 0.0,
    }


def UNIFORM(b: int, pos: int) -> int:
    return 0


def priority_fns(trace: Trace) -> dict[str, PriorityFn]:
    users = Counter(b for ids in trace for b in set(ids))
    return {
        "uniform": UNIFORM,
        "depth": lambda b, pos: pos,
        "shared": lambda b, pos: 0 if users[b] > 1 else 10,
    }


def load_trace(path: Path, limit: int | None, session_hints: bool = True) -> list[Request]:
    trace: list[Request] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(trace) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                session = r.get("session") if session_hints else None
                trace.append(Request(list(r["hash_ids"]), r.get("timestamp", 0) / 1000,
                                     None if session is None else str(session)))
    return trace


def _csv(kind: type, text: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", action="append", default=None, metavar="PATH|multiturn",
                    help="a JSONL trace with a hash_ids list per line (a `timestamp` in ms and a `session` "
                         f"are used when present), or `{GENERATED}` for benchmarks/traces.py's default trace "
                         f"(seed 0); repeat for several (default: {DEFAULT_TRACE} and {GENERATED})")
    ap.add_argument("--no-session-hints", action="store_true",
                    help="drop the traces' `session` fields, as for clients that send no cache_salt")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="where to write the JSON results; parent dirs are created "
                         "(default: %(default)s)")
    ap.add_argument("--limit", type=int, default=None, metavar="N",
                    help="replay only the first N requests (quick runs); default: all")
    ap.add_argument("--fractions", type=lambda s: _csv(float, s),
                    default=[0.01, 0.05, 0.10, 0.25, 0.50],
                    help="capacities as fractions of the replay's distinct blocks, comma-separated "
                         "(default: 0.01,0.05,0.1,0.25,0.5)")
    ap.add_argument("--capacities", type=lambda s: _csv(int, s), default=None,
                    help="absolute capacities in blocks, comma-separated; overrides --fractions")
    ap.add_argument("--policies", type=lambda s: [x.strip() for x in s.split(";") if x.strip()], default=["lru", "priority", "turn_lru"],
                    help="policy specs for make_policy (names, entry points, module:Class, or JSON "
                         "{\"name\": ..., \"options\": {...}}), separated by ';' "
                         "(default: lru;priority;turn_lru)")
    ap.add_argument("--priority-modes", type=lambda s: _csv(str, s), default=["depth"],
                    help="priority hints to run each non-LRU policy under, comma-separated, from "
                         "uniform,depth,shared (see above); LRU ignores priorities and runs once "
                         "(default: depth)")
    ap.add_argument("--no-belady", action="store_true",
                    help="skip the offline Belady MIN reference")
    ap.add_argument("--kv-quant", type=lambda s: _csv(float, s), default=None, metavar="RATIOS",
                    help="also replay LRU at each capacity times each ratio: the blocks the same tier bytes "
                         "hold with a smaller KV dtype (2: fp8 against bfloat16 KV, 4: against float32), "
                         "with hit tokens and the prefill seconds they save (issue 44)")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=PREFILL_TOKENS_PER_S,
                    help="prefill speed that turns hit tokens into seconds saved (default %(default)s: the demo "
                         "model's 8,000-token cold prefill in float32 on an AMD EPYC, 21.12 s, "
                         "docs/performance/tier-io.md)")
    args = ap.parse_args(argv)
    bad = set(args.priority_modes) - {"uniform", "depth", "shared"}
    if bad or not args.priority_modes:
        ap.error(f"--priority-modes: unknown {sorted(bad)}; choose from uniform, depth, shared")
    if any(r < 1 for r in args.kv_quant or []) or args.prefill_tokens_per_s <= 0:
        ap.error("--kv-quant ratios must be >= 1 and --prefill-tokens-per-s positive")
    if any(f <= 0 for f in args.fractions) or any(c < 1 for c in args.capacities or []):
        ap.error("capacities and fractions must be positive")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    args.trace = args.trace or [str(DEFAULT_TRACE), GENERATED]
    for name in args.trace:
        if name != GENERATED and not Path(name).is_file():
            ap.error(f"trace not found: {name}")
    return args


def variants_for(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, spec, priority mode) per column; ValueError for a spec that does not resolve."""
    variants: list[tuple[str, str, str]] = []
    for spec in args.policies:
        if make_policy(spec).name in ("lru", "turn_lru"):  # they ignore priorities: run once
            variants.append((spec, spec, "uniform"))
        else:
            variants += [(f"{spec}[{m}]", spec, m) for m in args.priority_modes]
    if not args.no_belady:
        variants.append(("belady", "belady", "uniform"))
    return variants


def run_trace(name: str, trace: list[Request], args: argparse.Namespace, variants: list[tuple[str, str, str]]) -> dict:
    """Replay one trace at every capacity through every variant; print its table."""
    blocks = [r.ids for r in trace]
    distinct = len({b for ids in blocks for b in ids})
    if args.capacities:
        caps = [(c, c / distinct) for c in args.capacities]
    else:
        caps = [(max(1, round(f * distinct)), f) for f in args.fractions]
    prios = priority_fns(blocks)
    results = []
    for cap, frac in caps:
        for label, spec, mode in variants:
            policy = BeladyPolicy(blocks) if spec == "belady" else make_policy(spec, capacity=cap)
            r = replay(policy, trace, cap, prios[mode])
            results.append({"policy": label, "spec": spec, "priority_mode": mode,
                            "capacity": cap, "fraction": frac, **r})

    unbounded = unbounded_hit_rate(blocks)
    hinted = sum(r.session is not None for r in trace)
    labels = [v[0] for v in variants]
    width = max(16, *(len(s) + 2 for s in labels))
    print(f"trace {name}: {len(trace)} requests ({hinted} with a session hint), "
          f"{sum(map(len, blocks))} block refs, {distinct} distinct blocks; "
          f"unbounded-cache hit rate {unbounded:.1%}")
    print("cells: block hit rate (block ops/s in thousands)")
    print(f"{'capacity':>16}" + "".join(f"{s:>{width}}" for s in labels))
    by_key = {(r["policy"], r["capacity"]): r for r in results}
    for cap, frac in caps:
        row = f"{cap:>8} ({frac:>5.1%})"
        for s in labels:
            r = by_key[(s, cap)]
            row += f"{r['hit_rate']:>{width - 8}.1%} ({r['ops_per_s'] / 1e3:>4.0f})"
        print(row)
    print()
    return {"trace": name, "requests": len(trace), "session_hints": hinted, "block_refs": sum(map(len, blocks)),
            "distinct_blocks": distinct, "unbounded_hit_rate": unbounded, "results": results}


def kv_quant_capacity(name: str, trace: list[Request], args: argparse.Namespace) -> list[dict]:
    """LRU at each capacity (blocks of the model dtype's KV) and at capacity x ratio (the blocks
    the same bytes hold with a smaller KV dtype): hit rate, hit tokens, prefill seconds saved."""
    blocks = [r.ids for r in trace]
    distinct = len({b for ids in blocks for b in ids})
    caps = args.capacities or [max(1, round(f * distinct)) for f in args.fractions]
    rows, out = [], []
    for cap in caps:
        base = None
        for ratio in (1.0, *args.kv_quant):
            held = round(cap * ratio)
            r = replay(make_policy("lru", capacity=held), trace, held, UNIFORM)
            tokens = r["hits"] * BLOCK_TOKENS
            base = base or r
            out.append({"capacity": cap, "ratio": ratio, "blocks": held, "hit_rate": r["hit_rate"], "hit_tokens": tokens,
                        "prefill_s_saved": tokens / args.prefill_tokens_per_s})
            rows.append(f"{cap:>9} {ratio:>6g}x {held:>8} {r['hit_rate']:>9.1%} {tokens:>14,} "
                        f"{tokens / args.prefill_tokens_per_s:>14,.0f} {r['hits'] / max(base['hits'], 1):>8.2f}x")
    print(f"trace {name}: LRU at equal tier bytes, KV {', '.join(f'{x:g}x' for x in args.kv_quant)} smaller "
          f"({BLOCK_TOKENS}-token blocks; seconds at {args.prefill_tokens_per_s:g} prefill tokens/s)")
    print(f"{'capacity':>9} {'ratio':>7} {'blocks':>8} {'hit rate':>9} {'hit tokens':>14} {'prefill s saved':>14} "
          f"{'vs 1x':>9}")
    print("\n".join(rows))
    print()
    return out


def load_named(name: str, args: argparse.Namespace) -> list[Request]:
    if name != GENERATED:
        return load_trace(Path(name), args.limit, not args.no_session_hints)
    out = []
    for r in generate(TraceSpec())[: args.limit]:
        session = None if args.no_session_hints else str(r["session"])
        out.append(Request(r["hash_ids"], r["timestamp"] / 1000, session))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        variants = variants_for(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = []
    for name in args.trace:
        trace = load_named(name, args)
        runs.append(run_trace(name, trace, args, variants))
        if args.kv_quant:
            runs[-1]["kv_quant"] = kv_quant_capacity(name, trace, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "policies", "python": sys.version.split()[0],
                                    "argv": sys.argv[1:] if argv is None else argv, "traces": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")
    plot_file(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
