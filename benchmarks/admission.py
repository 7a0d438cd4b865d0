#!/usr/bin/env python3
"""Which blocks should be written to G3 at all? Admission rules replayed on prefix traces (issue 43).

Replays Mooncake's synthetic trace and the generated multi-turn trace (benchmarks/traces.py) through
two LRU levels: the upper tiers (G1 + G2, --upper blocks) and G3 (--g3 blocks), with one admission
rule for G3 at a time:
  always     every block the engine computes is written (write-through; kvtier's G3 today)
  uses:K     a block is written once requests have used it K times (computed or hit), as G4's
             min_uses and KVBM's "accessed twice before disk"
  evicted    a block is written when the upper tiers evict it (a victim cache; SGLang HiCache's
             write_back in spirit)
  turn:K[@Q] (traces with `session` and `turn`, like the generated one) blocks computed from a
             session's K-th turn on (1-based) are written, and, at random, a share Q of earlier turns'
             sessions (default 0); shared blocks are written on their second use, as uses:2. The
             generator's sessions go on after turn k with P = (k/(k+1))^alpha, independently of
             anything a rule sees, so sorting by turn is the best a rule can do there, and Q walks
             the line between its two ends.
  continues  a BOUND, not a rule: a computed block is written iff its session has a later turn,
             as if continuation were known when the block is computed (plus uses:2).
  oracle     an ORACLE, not a rule: a computed block is written iff a later request uses it again.
             It bounds what any rule can save without losing hits.
Per request: the prefix hit is the longest run of leading blocks found in the upper tiers or G3 (G3
hits are promoted up); the rest is computed and inserted in the upper tiers. Reported per rule: hit
blocks (all tiers), G3 hit blocks, G3 writes, and G3 writes per hit block, against `always`.
Target: writes per hit fall >= 2x with hit blocks within 3% of `always`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(REPO))

from benchmarks.policies import DEFAULT_TRACE, GENERATED  # noqa: E402  (the traces policies.py replays)
from benchmarks.traces import TraceSpec, generate  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "admission.json"
RULES = ("always", "uses:2", "uses:3", "evicted", "turn:2", "turn:2@0.5", "turn:2@0.9", "continues", "oracle")
VERDICT = {"always": "-", "continues": "bound", "oracle": "bound"}  # not rules: no verdict
SESSION_RULES = ("turn:", "continues")  # need the trace's `session` and `turn`
HITS_WITHIN = 0.03
WRITES_FALL = 2.0


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.d = capacity, OrderedDict()

    def __contains__(self, k: int) -> bool:
        return k in self.d

    def touch(self, k: int) -> None:
        self.d.move_to_end(k)

    def insert(self, k: int) -> list[int]:
        """Insert (or touch) k; returns the evicted keys."""
        if k in self.d:
            self.d.move_to_end(k)
            return []
        self.d[k] = None
        out = []
        while len(self.d) > self.capacity:
            out.append(self.d.popitem(last=False)[0])
        return out


def parse_rule(rule: str) -> tuple[str, int, float]:
    """(kind, K, Q) for a --rules entry; ValueError names what is wrong."""
    if rule in ("always", "evicted", "oracle", "continues"):
        return rule, 0, 0.0
    kind, _, arg = rule.partition(":")
    k, _, q = arg.partition("@")
    if kind not in ("uses", "turn") or not k.isdigit() or int(k) < 1 or (q and kind != "turn"):
        raise ValueError(f"{rule!r} is not always, evicted, oracle, continues, uses:K or turn:K[@Q]")
    share = float(q) if q else 0.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{rule!r}: Q must be in [0, 1]")
    return kind, int(k), share


def session_predicate(rule: str, sessions: list[dict]) -> Callable[[int], bool]:
    """Whether request i's computed blocks are written, for turn:K[@Q] and continues."""
    kind, k, share = parse_rule(rule)
    if kind == "continues":
        last: dict[int, int] = {}
        for r in sessions:
            last[r["session"]] = max(last.get(r["session"], -1), r["turn"])
        return lambda i: sessions[i]["turn"] < last[sessions[i]["session"]]
    coin = random.Random(f"{rule}:coin")
    chosen: dict[int, bool] = {}
    def pick(i: int) -> bool:
        s = sessions[i]["session"]
        if s not in chosen:
            chosen[s] = coin.random() < share
        return sessions[i]["turn"] + 1 >= k or chosen[s]
    return pick


def replay(trace: list[list[int]], upper_cap: int, g3_cap: int, rule: str,
           sessions: list[dict] | None = None) -> dict:
    upper, g3 = LRU(upper_cap), LRU(g3_cap)
    kind, k, _ = parse_rule(rule)
    by_session = None
    if rule.startswith(SESSION_RULES):
        if sessions is None:
            raise ValueError(f"{rule!r} needs a trace with `session` and `turn`")
        by_session, k = session_predicate(rule, sessions), 2
    elif kind != "uses":
        k = 0
    uses: dict[int, int] = {}
    hits = g3_hits = writes = refs = 0
    reused: set[tuple[int, int]] = set()  # (request index, position) whose block a later request uses
    if rule == "oracle":
        seen: set[int] = set()
        for i in range(len(trace) - 1, -1, -1):
            for j, b in enumerate(trace[i]):
                if b in seen:
                    reused.add((i, j))
            seen.update(trace[i])

    def write(b: int) -> None:
        nonlocal writes
        if b not in g3:
            g3.insert(b)
            writes += 1

    def up(b: int) -> None:
        for victim in upper.insert(b):
            if rule == "evicted":
                write(victim)

    for i, ids in enumerate(trace):
        refs += len(ids)
        n = 0
        for b in ids:  # the prefix hit
            if b in upper:
                upper.touch(b)
            elif b in g3:
                g3.touch(b)
                g3_hits += 1
                up(b)
            else:
                break
            n += 1
        hits += n
        for j, b in enumerate(ids[n:], n):  # computed
            up(b)
            if rule == "always" or (i, j) in reused or (by_session is not None and by_session(i)):
                write(b)
        if k:
            for b in ids:
                c = uses.get(b, 0) + 1
                uses[b] = c
                if c >= k:
                    write(b)
    return {"rule": rule, "hit_blocks": hits, "g3_hit_blocks": g3_hits, "g3_writes": writes, "block_refs": refs,
            "writes_per_hit": writes / max(hits, 1)}


def load(name: str, limit: int | None) -> tuple[list[list[int]], list[dict] | None]:
    """The trace's block ids per request, and its sessions and turns where every request has them."""
    if name == GENERATED:
        records = generate(TraceSpec())[:limit]
    else:
        records = []
        with Path(name).open() as f:
            for line in f:
                if line.strip():
                    records.append(json.loads(line))
                    if limit is not None and len(records) >= limit:
                        break
    sessions = [{"session": r["session"], "turn": r["turn"]} for r in records] \
        if all("session" in r and "turn" in r for r in records) else None
    return [r["hash_ids"] for r in records], sessions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", help=f"trace files (JSONL with hash_ids) or {GENERATED!r} "
                    f"(default: {DEFAULT_TRACE.name} and {GENERATED})")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--upper", default="0.02,0.05", help="upper-tier capacities, fractions of the trace's distinct "
                    "blocks (default %(default)s)")
    ap.add_argument("--g3", type=float, default=0.3, help="G3 capacity, a fraction of distinct blocks (default %(default)s)")
    ap.add_argument("--rules", default=",".join(RULES), help="admission rules (default %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    for r in rules:
        try:
            parse_rule(r)
        except ValueError as e:
            ap.error(f"--rules: {e}")
    if "always" not in rules:
        rules.insert(0, "always")
    out = []
    for name in args.trace or [str(DEFAULT_TRACE), GENERATED]:
        trace, sessions = load(name, args.limit)
        distinct = len({b for ids in trace for b in ids})
        g3_cap = max(1, int(args.g3 * distinct))
        print(f"trace {Path(name).name}: {len(trace)} requests, {sum(map(len, trace))} block refs, {distinct} distinct "
              f"blocks; G3 holds {g3_cap}")
        print(f"{'upper':>7} {'rule':>10} {'hit blocks':>11} {'G3 hits':>9} {'G3 writes':>10} {'writes/hit':>11} "
              f"{'hits vs always':>15} {'writes/hit vs always':>21}  verdict")
        for frac in (float(x) for x in args.upper.split(",")):
            upper_cap = max(1, int(frac * distinct))
            base = None
            for rule in rules:
                if sessions is None and rule.startswith(SESSION_RULES):
                    print(f"{upper_cap:>7} {rule:>10}  skipped: the trace has no sessions and turns")
                    continue
                t0 = time.perf_counter()
                r = replay(trace, upper_cap, g3_cap, rule, sessions) | {"trace": Path(name).name, "upper_blocks": upper_cap,
                                                               "g3_blocks": g3_cap, "seconds": time.perf_counter() - t0}
                base = base or r
                hits_rel = r["hit_blocks"] / max(base["hit_blocks"], 1)
                fall = base["writes_per_hit"] / max(r["writes_per_hit"], 1e-12)
                r |= {"hits_vs_always": hits_rel, "writes_per_hit_fall": fall,
                      "meets": rule not in VERDICT and hits_rel >= 1 - HITS_WITHIN and fall >= WRITES_FALL}
                out.append(r)
                print(f"{upper_cap:>7} {rule:>10} {r['hit_blocks']:>11} {r['g3_hit_blocks']:>9} {r['g3_writes']:>10} "
                      f"{r['writes_per_hit']:>11.3f} {hits_rel:>15.1%} {fall:>20.2f}x  "
                      f"{VERDICT.get(rule) or ('meets' if r['meets'] else 'misses')}")
        print()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "admission", "argv": sys.argv[1:] if argv is None else argv,
                                    "results": out}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
