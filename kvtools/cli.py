"""`kvtier kv`: look at, check and empty a persistent KV tier (a G3 directory or a G4 Redis).

    kvtier kv inspect DIR|URL [--namespace NS] [--json]
    kvtier kv verify  DIR|URL [--remove] [--kv-offload-secret-file PATH] [--namespace NS] [--json]
    kvtier kv clear   DIR|URL [--namespace NS] [--json]
    kvtier kv events  ENDPOINT... [--topic T] [--interval S] [--duration S] [--json] [--stats-url NAME=URL]

`events` is kvtools/events_cli.py's: it watches replicas' KV events rather than a stored tier.

The reading and removing is kvstore's (`inspect_disk.py`, `inspect_redis.py`, reports in
`inspect_report.py`); this module parses flags and prints. Safe on a live server's tier: only
kvtier's own entries are ever removed, whole files or keys at a time, never a live writer's
temp file (see those modules).

Exit codes: 0 done and (verify) every entry good; 1 verify found bad entries, or clear could not
remove some; 2 bad input or an unreachable tier (a one-line message on stderr, never a
traceback); 3 verify found no bad entry but could not check some keyed ones (no secret given).
`events` exits 0 when stopped (--duration, Ctrl-C) and 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from kvstore.entry import ENV_SECRET, EntryCodec, load_secret
from kvtools.inspect_report import (AGE_BUCKETS, EXIT_BAD, EXIT_CLEAN, EXIT_UNVERIFIED, UNKNOWN_AGE, ClearReport,
                                    DirTarget, Summary, TierUnavailable, VerifyReport, parse_namespace, parse_target)
from kvtools import events_cli as kv_events_cli

REDIS_TIMEOUT_S = 5.0  # G4: each command's socket timeout, unless --timeout-s

PROG = "kvtier kv"
USAGE_ERROR = 2


def _namespace(text: str) -> bytes:
    try:
        return parse_namespace(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify or clear a persistent KV tier: a G3 directory (--kv-offload-disk) or "
                               "a G4 Redis/Valkey URL (--kv-offload-remote). Safe on a live server's tier. Or watch "
                               "replicas' KV events: which blocks each holds in which tier (events).",
        epilog=f"exit codes: {EXIT_CLEAN} ok, {EXIT_BAD} bad entries found (verify) or not all removed (clear), "
               f"{USAGE_ERROR} bad input or unreachable tier, {EXIT_UNVERIFIED} keyed entries left unverified (verify "
               "without the secret); events: 0 when stopped, 2 on bad input")
    sub = p.add_subparsers(dest="command", metavar="{inspect,verify,clear,events}", required=True)
    inspect = sub.add_parser("inspect", help="entries, bytes, namespaces (with their model) and ages",
                             description="Count entries and bytes per namespace, name the model each belongs to "
                                         "(from the record the tier writes when it opens) and bucket their ages: "
                                         "G3 since written (file mtime), G4 since last access (OBJECT IDLETIME).")
    verify = sub.add_parser("verify", help="read and check every entry; report (and --remove) the bad ones",
                            description="Read every entry and make the checks the tier makes on a read: header and "
                                        "header checksum/MAC, namespace and key, size, payload checksum/MAC. Each "
                                        "bad entry is listed with why. Keyed entries (written with a KV secret) "
                                        "need the same secret; without it they are reported as unverified, never "
                                        "as corrupt, and never removed.")
    clear = sub.add_parser("clear", help="remove the entries (all, or one namespace's)",
                           description="Remove every entry, or one namespace's (--namespace), and temp files left by "
                                       "interrupted writes. Namespace records, directories, live writers' temp files "
                                       "and anything that is not kvtier's stay.")
    for sp in (inspect, verify, clear):
        sp.add_argument("target", metavar="DIR|URL",
                        help="a G3 directory (the --kv-offload-disk path) or a G4 URL: redis://[user:pass@]host:port"
                             "[/db], rediss://..., redis+cluster://host:port,...; credentials may come from "
                             "$KVTIER_REDIS_USERNAME / $KVTIER_REDIS_PASSWORD")
        sp.add_argument("--namespace", type=_namespace, default=None, metavar="NS",
                        help="only this namespace (32 hex digits, as inspect lists them)")
        sp.add_argument("--json", action="store_true", help="print the report as one JSON object")
        sp.add_argument("--prefix", default=None,
                        help="G4 only: the key prefix (the engine's g4_prefix, or a redis tier's prefix; "
                             "default: kvtier)")
        sp.add_argument("--timeout-s", type=float, default=None, metavar="SECONDS",
                        help=f"G4 only: socket timeout of each command (default: {REDIS_TIMEOUT_S})")
    verify.add_argument("--remove", action="store_true",
                        help="delete the bad entries (only if unchanged since they were read) and stale temp files")
    verify.add_argument("--kv-offload-secret-file", default=None, metavar="PATH",
                        help="the KV secret file the tier uses, so keyed (MAC'd) entries can be verified; default: "
                             f"${ENV_SECRET} if set. With a secret, unkeyed entries are bad (the tier rejects them)")
    kv_events_cli.add_parser(sub)
    return p


def main(argv: list[str]) -> int:
    try:
        ns = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error (2) or the help (0)
        return e.code if isinstance(e.code, int) else USAGE_ERROR
    try:
        return _run(ns)
    except (ValueError, TierUnavailable) as e:
        print(f"{PROG} {ns.command}: error: {e}", file=sys.stderr)
        return USAGE_ERROR


def _run(ns: argparse.Namespace) -> int:
    if ns.command == "events":
        return kv_events_cli.run(ns)
    target = parse_target(ns.target)
    if isinstance(target, DirTarget):
        for flag, value in (("--prefix", ns.prefix), ("--timeout-s", ns.timeout_s)):
            if value is not None:
                raise ValueError(f"{flag} applies to a Redis URL, not a directory")
        return _on_dir(ns, target)
    from kvtools.inspect_redis import RedisTool

    tool = RedisTool(target, ns.prefix or "kvtier", REDIS_TIMEOUT_S if ns.timeout_s is None else ns.timeout_s)
    try:
        return _dispatch(ns, tool.inspect, tool.verify, tool.clear)
    finally:
        tool.close()


def _on_dir(ns: argparse.Namespace, target: DirTarget) -> int:
    from functools import partial

    from kvtools import inspect_disk

    root = target.root
    return _dispatch(ns, partial(inspect_disk.inspect_dir, root), partial(inspect_disk.verify_dir, root),
                     partial(inspect_disk.clear_dir, root))


def _dispatch(ns: argparse.Namespace, inspect: Callable[..., Summary], verify: Callable[..., VerifyReport],
              clear: Callable[..., ClearReport]) -> int:
    if ns.command == "inspect":
        summary = inspect(namespace=ns.namespace)
        _emit(ns, summary.to_dict(), _format_summary(summary))
        return EXIT_CLEAN
    if ns.command == "verify":
        codec = EntryCodec(load_secret(ns.kv_offload_secret_file))
        report = verify(codec, remove=ns.remove, namespace=ns.namespace)
        _emit(ns, report.to_dict(), _format_verify(report, codec.keyed))
        return report.exit_code
    cleared = clear(namespace=ns.namespace)
    _emit(ns, cleared.to_dict(), _format_clear(cleared))
    return EXIT_BAD if cleared.failed else EXIT_CLEAN


def _emit(ns: argparse.Namespace, data: dict[str, Any], lines: list[str]) -> None:
    print(json.dumps(data, indent=1, sort_keys=True) if ns.json else "\n".join(lines))


# ---- text output --------------------------------------------------------------------------------

def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _ages(ages: dict[str, int]) -> str:
    labels = [label for _, label in AGE_BUCKETS] + ([UNKNOWN_AGE] if ages.get(UNKNOWN_AGE) else [])
    return ", ".join(f"{label} {ages.get(label, 0)}" for label in labels)


def _format_summary(s: Summary) -> list[str]:
    lines = [f"{s.tier} {s.location}: {s.entries} entries, {_size(s.bytes)}, {len(s.namespaces)} namespace(s)",
             f"ages (since {s.age_basis}): {_ages(s.ages)}"]
    for n in s.namespaces:
        lines += [f"namespace {n.namespace}  model: {n.model}",
                  f"  {n.entries} entries, {_size(n.bytes)}; ages {_ages(n.ages)}"]
    if s.in_flight or s.stale:
        lines.append(f"temp files: {s.in_flight} being written, {s.stale} left by interrupted writes")
    if s.foreign:
        lines.append(f"{s.foreign} name(s) that are not kvtier's, left alone")
    return lines + [f"note: {note}" for note in s.notes]


def _format_verify(r: VerifyReport, keyed: bool) -> list[str]:
    lines = [f"BAD {p.where}: {p.reason}{' [removed]' if p.removed else ''}" for p in r.bad]
    removed = sum(p.removed for p in r.bad)
    lines.append(f"{r.tier} {r.location}: {r.checked} entries checked{' with the KV secret' if keyed else ''}: "
                 f"{r.good} good, {len(r.bad)} bad" + (f" ({removed} removed)" if removed else "")
                 + (f", {len(r.unverified)} unverified" if r.unverified else ""))
    if r.unverified:
        lines.append(f"{len(r.unverified)} keyed entries (MAC'd with a KV secret) were not verified: give the "
                     f"tier's secret with --kv-offload-secret-file or ${ENV_SECRET}; they were not removed")
    if r.in_flight:
        lines.append(f"{r.in_flight} temp file(s) of live writers left alone")
    if r.foreign:
        lines.append(f"{r.foreign} name(s) that are not kvtier's, left alone")
    return lines + [f"note: {note}" for note in r.notes]


def _format_clear(c: ClearReport) -> list[str]:
    size = "" if c.bytes is None else f" ({_size(c.bytes)})"
    lines = [f"FAILED {p.where}: {p.reason}" for p in c.failed]
    lines.append(f"{c.tier} {c.location}: removed {c.removed} entries{size}")
    if c.in_flight:
        lines.append(f"{c.in_flight} temp file(s) of live writers left alone")
    if c.foreign:
        lines.append(f"{c.foreign} name(s) that are not kvtier's, left alone")
    return lines

