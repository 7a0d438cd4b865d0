"""soak.py's report: each fault's counter deltas, recovery and failed requests, the findings
only the whole run shows, the per-minute hit rates, and the three tables (summary, faults, per
minute) with the JSON document that carries them and every request, fault and sample.

Imported by soak.py after it has put the repo root first on sys.path and benchmarks/ last.
"""
from __future__ import annotations

import argparse
import math
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from _chaos import DAMAGE_KINDS, FAULT_KINDS, Fault
from _common import format_table
from _soak_stats import LOWER_TIERS, Counters

if TYPE_CHECKING:
    from _soak_run import Soak


def charge_faults(counters: Counters, faults: list[Fault], recs: list[dict[str, Any]], duration: float) -> list[float]:
    """Fill in each fault's effect, first success after it, window and failed requests (a core
    kill's recovery too), and each failed request's fault; returns the start times of the flips."""
    # Counter deltas per fault: from its start to the next fault's; a flip's damage is found whenever
    # the entry is read, so its corrupt counts run to the next flip (and no other row shows them).
    ends = [f.t_start for f in faults[1:]] + [duration]
    flip_starts = [f.t_start for f in faults if f.kind in DAMAGE_KINDS and not f.skipped]
    corrupt_keys = (*(f"{t}.corrupt" for t in LOWER_TIERS), "offload.load_failures")
    for f, end in zip(faults, ends):
        if f.kind in DAMAGE_KINDS:
            end = next((t for t in flip_starts if t > f.t_start), duration)
            keys: tuple[str, ...] = corrupt_keys
        else:
            keys = ("G3.write_errors", "G4.outages", "G4.failed_writes", "G4.dropped_writes")
        a, b = counters.at(f.t_start - 1e-6), counters.at(end)
        f.effect = {k: b[k] - a[k] for k in keys if b[k] - a[k]}
        # Only a core kill takes the server down: a response after the next one is not this one's.
        nxt = next((g.t_start for g in faults if g.t_start > f.t_start and g.kind == "core_kill"), math.inf)
        after = [r["done"] for r in recs if r["ok"] and f.t_start <= r["sent"] and r["done"] < nxt]
        if after:
            f.first_ok_after_s = min(after) - f.t_start
            if f.kind == "core_kill":
                f.recovery_s = f.first_ok_after_s
        elif f.kind == "core_kill" and not f.skipped:
            f.notes.append("no successful response before the next core kill" if nxt < math.inf
                           else "no successful response before the end")
        window_end = f.t_start + max(f.recovery_s or 0.0, (f.t_clear or f.t_start) - f.t_start) + 5.0
        f.detail["window_end_s"] = round(window_end, 1)
    for r in recs:
        if r["ok"]:
            continue
        owner = [f for f in faults if r["done"] >= f.t_start and r["sent"] <= f.detail["window_end_s"]]
        r["fault"] = owner[-1].id if owner else None  # the latest fault it overlaps
        if owner:
            owner[-1].failed_requests += 1
    return flip_starts


def per_minute(counters: Counters, faults: list[Fault], recs: list[dict[str, Any]], duration: float,
               minutes_asked: float) -> list[dict[str, Any]]:
    """One row a minute of the chaos phase: requests, prompt tokens, each tier's hits, corrupt entries, faults."""
    minutes = []
    n_min = max(1, math.ceil(min(duration, minutes_asked * 60) / 60 - 1e-9))
    for m in range(n_min):  # the last bucket also takes the requests still in flight at the deadline
        lo, hi = m * 60, (m + 1) * 60 if m < n_min - 1 else max(duration, (m + 1) * 60)
        a, b = counters.at(lo), counters.at(hi)
        pt = b["prompt_tokens"] - a["prompt_tokens"]
        row = {"minute": m + 1, "sent": sum(lo <= r["sent"] < hi for r in recs),
               "ok": sum(lo <= r["done"] < hi and r["ok"] for r in recs),
               "failed": sum(lo <= r["done"] < hi and not r["ok"] for r in recs),
               "wrong": sum(lo <= r["done"] < hi and r["wrong"] for r in recs), "prompt_tokens": int(pt),
               "corrupt_detected": int(sum(b[f"{t}.corrupt"] - a[f"{t}.corrupt"] for t in LOWER_TIERS)),
               "faults": [f"{f.id}:{f.kind}" for f in faults if lo <= f.t_start < hi]}
        for tier in ("G1", *LOWER_TIERS):
            h = b[f"{tier}.hit_tokens"] - a[f"{tier}.hit_tokens"]
            row[f"{tier}_hit_tokens"] = int(h)
            row[f"{tier}_hit_rate"] = h / pt if pt > 0 else None
        minutes.append(row)
    return minutes


def tables(summary: dict[str, Any], faults: list[Fault], minutes: list[dict[str, Any]], duration: float,
           args: argparse.Namespace) -> str:
    """The summary table, the faults table (when there were any) and the per-minute table."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    cause_s = ", ".join(f"{c} {n}" for c, n in Counter(summary["failed_by_cause"]).most_common()) or "none"
    corrupt = summary["corrupt_entries_detected"]
    rows = [
        ["duration", f"{duration / 60:.1f} min ({args.concurrency} in flight, {args.tenants} tenants)"],
        ["requests sent", summary["requests_sent"]], ["completed", summary["completed"]],
        ["failed (no retry)", f"{summary['failed']}: {cause_s}"],
        ["wrong outputs (must be 0)", summary["wrong_outputs"]],
        ["completed with lower-tier hits", summary["completed_with_lower_tier_hits"]],
        ["corrupt entries detected", f"{corrupt['total']} (G2 {corrupt['G2']}, G3 {corrupt['G3']}, "
                                     f"G4 {corrupt['G4']}); {summary['interrupted_write_temp_files_removed']} "
                                     "of them temp files of killed writes"],
        ["corrupt entries served (must be 0)", summary["corrupt_entries_served"]],
        ["G3 files with a flipped byte", summary["g3_files_flipped"]],
        ["faults", ", ".join(f"{k} {n}" for k, n in summary["faults"].items()) or "none"],
        ["server restarts", summary["server_restarts"]],
        ["findings", "; ".join(f"{k}{f' (x{n})' if n > 1 else ''}"
                               for k, n in Counter(x["finding"] for x in summary["findings"]).items()) or "none"],
    ]
    text = [format_table(["soak", "result"], rows), ""]
    frows = []
    for f in faults:
        eff = ", ".join(f"{k} +{v:.0f}" for k, v in f.effect.items())
        if f.kind in DAMAGE_KINDS:
            eff = f"{eff or 'none'} (until the next damage)"
        frows.append([f.id, round(f.t_start), f.kind, ("SKIPPED: " if f.skipped else "") + f.method,
                      f.failed_requests, None if f.recovery_s is None else round(f.recovery_s, 1),
                      f.recovery_what if f.recovery_s is not None or f.notes == [] else "; ".join(f.notes),
                      eff or "-"])
    if frows:
        text += [format_table(["#", "t s", "fault", "how", "failed", "recovery s", "recovery is",
                               "counters until the next fault"],
                              frows), ""]
    mrows = [[m["minute"], m["sent"], m["ok"], m["failed"], m["wrong"], m["prompt_tokens"],
              pct(m["G1_hit_rate"]), pct(m["G2_hit_rate"]), pct(m["G3_hit_rate"]), pct(m["G4_hit_rate"]),
              m["corrupt_detected"], " ".join(m["faults"]) or "-"] for m in minutes]
    text.append(format_table(["min", "sent", "ok", "failed", "wrong", "prompt tok", "G1 hit", "G2 hit", "G3 hit",
                              "G4 hit", "corrupt", "faults"], mrows))
    return "\n".join(text)


def report(soak: Soak, duration: float) -> tuple[dict[str, Any], str]:
    """The JSON document (soak.py adds the workload, config and oracle to it) and the tables.
    Charges the failed requests to the faults and adds the findings only the whole run shows."""
    recs = sorted(soak.records, key=lambda r: r["sent"])
    faults = soak.chaos.faults
    flip_starts = charge_faults(soak.counters, faults, recs, duration)
    # G3 counts the temp file of a write its killed core left behind as corrupt too (a "bad file").
    log_lines = [line.strip() for _, lines in soak.logs for line in lines
                 if "corrupt" in line.lower() or "bad file" in line.lower()]
    tmp_files = sum("interrupted write" in line for line in log_lines)
    before_flip = soak.counters.at(flip_starts[0] if flip_starts else duration)
    if sum(before_flip[f"{t}.corrupt"] for t in LOWER_TIERS) > tmp_files:
        soak.finding("corrupt entries detected before any entry was damaged (beyond temp files of killed writes)",
                     **{t: before_flip[f"{t}.corrupt"] for t in LOWER_TIERS}, log=log_lines[:5])
    no_fault = [r for r in recs if not r["ok"] and r["fault"] is None]
    if no_fault:
        soak.finding("requests failed outside every fault window", count=len(no_fault),
                     causes=dict(Counter(r["cause"] for r in no_fault)))

    ok = [r for r in recs if r["ok"]]
    wrong = [r for r in ok if r["wrong"]]
    # A wrong output is attributed to a lower tier unless its request provably had no lower-tier hit.
    served = [r for r in wrong if not (r.get("cached") == 0 or r.get("lower_hit_tokens_window") == 0)]
    cum, _ = soak.counters.now()
    corrupt = {t: int(cum[f"{t}.corrupt"]) for t in LOWER_TIERS}
    flips = [f for f in faults if f.kind == "g3_flip"]
    with_lower = sum(1 for r in ok if (r.get("lower_hit_tokens_window") or 0) > 0 and (r.get("cached") or 0) > 0)

    minutes = per_minute(soak.counters, faults, recs, duration, soak.args.minutes)

    causes = Counter(r["cause"] for r in recs if not r["ok"])
    summary = {
        "duration_s": round(duration, 1), "requests_sent": len(recs), "completed": len(ok),
        "failed": len(recs) - len(ok), "failed_by_cause": dict(causes),
        "failed_by_fault_kind": dict(Counter(next((f.kind for f in faults if f.id == r["fault"]), "none")
                                             for r in recs if not r["ok"])),
        "wrong_outputs": len(wrong), "corrupt_entries_detected": {**corrupt, "total": sum(corrupt.values())},
        "corrupt_log_lines": len(log_lines), "interrupted_write_temp_files_removed": tmp_files,
        "corrupt_entries_served": len(served),
        "completed_with_lower_tier_hits": with_lower,
        "g3_files_flipped": sum(f.detail.get("files_flipped", 0) for f in flips),
        "server_restarts": soak.inc, "faults": dict(Counter(f.kind for f in faults if not f.skipped)),
        "faults_skipped": [f"{f.id}:{f.kind}" for f in faults if f.skipped],
        "recovery_s": {k: [round(f.recovery_s, 1) if f.recovery_s is not None else None
                           for f in faults if f.kind == k and not f.skipped] for k in FAULT_KINDS},
        "findings": soak.findings, "fatal": soak.fatal,
    }

    text = tables(summary, faults, minutes, duration, soak.args)
    doc = {"summary": summary, "faults": [asdict(f) for f in faults], "hit_rate_per_minute": minutes,
           "wrong": [{k: r.get(k) for k in ("n", "pass", "idx", "tenant", "inc", "sent", "diverge_at", "oracle_margin",
                                          "lower_hit_tokens_window", "cached", "got", "want")} for r in wrong],
           "failures": [{k: r.get(k) for k in ("n", "idx", "inc", "sent", "done", "cause", "msg", "fault")}
                        for r in recs if not r["ok"]],
           "requests": [[round(r["sent"], 2), round(r["done"], 2), r["inc"], r["pass"], r["idx"], r["ok"],
                         r["cause"], r["wrong"], r.get("cached"), r.get("lower_hit_tokens_window")] for r in recs],
           "requests_columns": ["sent_s", "done_s", "server", "pass", "idx", "ok", "cause", "wrong", "cached_tokens",
                                "lower_hit_tokens_window"],
           "samples": [[round(t, 2), inc, {k: v for k, v in cum.items() if v}, br]
                       for t, inc, cum, br in soak.counters.series[::max(1, len(soak.counters.series) // 2000)]]}
    return doc, text
