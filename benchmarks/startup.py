"""How long `kvtier serve` takes from its command to its ready line, and from SIGTERM to its exit,
per variant, interleaved.

Variants: compiled (the default, -O1 on CPU) and eager (-O 0); with `--against DIR` (another
checkout, e.g. `git worktree add /tmp/old REV`) the same two from that tree too, so a change's
effect on start-up is measured in one run on one machine. Each start is stopped at once (SIGTERM)
after its ready line, and the stop is timed too (a drain with nothing in flight). The first round is a warm-up (inductor's cache, the page cache) and is not
reported unless --warmup 0.

    .venv/bin/python benchmarks/startup.py --runs 3 --against /tmp/old
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import RESULTS_DIR, log, median, print_table, run_interleaved, write_json  # noqa: E402

from server.launch import READY, REPO_ROOT  # noqa: E402


def time_start(tree: Path, args: list[str], timeout: float) -> tuple[float, float]:
    """Seconds from spawning `kvtier serve ARGS --port 0` in `tree` to its ready line, and from
    SIGTERM right after it to the process's exit."""
    cmd = [sys.executable, "-m", "server.cli", "serve", *args, "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: list[str] = []
    ready = None
    try:
        for line in proc.stdout:  # the server's own output; ends if it exits
            seen.append(line)
            if READY.search(line):
                ready = time.perf_counter() - t0
                break
            if time.perf_counter() - t0 > timeout:
                break
        if ready is None:
            raise RuntimeError(f"{tree}: no ready line (exit {proc.poll()}):\n{''.join(seen)[-3000:]}")
        t1 = time.perf_counter()
        proc.terminate()
        # Drained to EOF: a full pipe would stall its shutdown logging, and EOF comes once the
        # engine core (which shares the pipe) has exited too.
        drain = threading.Thread(target=proc.stdout.read, daemon=True)
        drain.start()
        proc.wait(120)
        drain.join(120)
        return ready, time.perf_counter() - t1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the demo model)")
    ap.add_argument("--runs", type=int, default=3, help="timed rounds (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default %(default)s)")
    ap.add_argument("--against", type=Path, help="another checkout to time the same way (before/after a change)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per start (default %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "startup.json", help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")
    if args.against is not None and not (args.against / "server" / "cli.py").is_file():
        ap.error(f"--against {args.against}: not a kvtier checkout (no server/cli.py)")
    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    base = [args.model, "--max-model-len", "2048"]
    trees = {"this": REPO_ROOT, **({"against": args.against.resolve()} if args.against else {})}
    variants = {f"{name} {level}": (tree, [*base, *flags]) for name, tree in trees.items()
                for level, flags in (("compiled", []), ("-O 0", ["-O", "0"]))}
    items = {name: (lambda r, t=tree, a=a: time_start(t, a, args.timeout)) for name, (tree, a) in variants.items()}
    runs = run_interleaved(args.warmup + args.runs, items,
                           lambda r, name, s: log(f"[round {r + 1}] {name}: ready after {s[0]:.1f} s, "
                                                  f"stopped {s[1]:.1f} s after SIGTERM"))
    timed = {name: [x[0] for x in v[args.warmup:]] for name, v in runs.items()}
    stops = {name: [x[1] for x in v[args.warmup:]] for name, v in runs.items()}
    print_table(["variant", "ready, median s", "runs", "stop, median s", "runs"],
                [[n, f"{median(v):.1f}", ", ".join(f"{x:.1f}" for x in v), f"{median(stops[n]):.2f}",
                  ", ".join(f"{x:.2f}" for x in stops[n])] for n, v in timed.items()])
    write_json(args.out, {"benchmark": "startup", "model": args.model, "trees": {k: str(v) for k, v in trees.items()},
                          "runs": timed, "stop_runs": stops,
                          "warmup_runs": {n: [x[0] for x in v[:args.warmup]] for n, v in runs.items()},
                          "median_s": {n: median(v) for n, v in timed.items()},
                          "stop_median_s": {n: median(v) for n, v in stops.items()}})
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
