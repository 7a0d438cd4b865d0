"""Issue 38, acceptance 1: can one request stall or kill `kvtier serve`? Each hostile request
class (benchmarks/_hostile.py: 50,000 bad_words, a 60,000-entry choice, a 20,000-entry enum, a
240-deep schema, 2,000 tools with tool_choice "required", a 7 MB prompt (two at once), and
prompt_logprobs=20 with n=16 on a long prompt) is sent while a probe client sends a short
greedy completion again and again. Per class: the hostile request's status and time, and the
probe's worst and median latency against its idle latency, measured just before.

Targets: an answer or a 400 within 2 s (1 s for the 7 MB prompts); the probe within 2x idle.
The prompt-logprobs request is an answer (its time is its own work); its target is the probe's.

    .venv/bin/python benchmarks/hostile.py                    # the demo model, default limits
    .venv/bin/python benchmarks/hostile.py --request-limits '{"choice": 100000, ...}'

Writes benchmarks/results/hostile.json, and the server's log beside it (hostile.log).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import httpx  # noqa: E402

from _common import RESULTS_DIR, log, machine_info, print_table, write_json  # noqa: E402
from _hostile import classes  # noqa: E402
from server.launch import launch  # noqa: E402

PROBE = {"prompt": "Write one short sentence about the sea.", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
# The probe client is a process of its own: in this one, reading a hostile request's 80 MB
# answer would hold the GIL the probe's client needs, and the probe would measure its client.
PROBER = r"""
import json, select, sys, time, httpx
url, body = sys.argv[1], json.loads(sys.argv[2])
with httpx.Client(base_url=url, timeout=600) as c:
    while (cmd := sys.stdin.readline().strip()) not in ("", "stop"):
        n, sent = int(cmd), 0  # n == 0: until the next line comes
        while n == 0 or sent < n:
            t0 = time.monotonic()
            c.post("/v1/completions", json=body).raise_for_status()
            print(t0, time.monotonic() - t0, flush=True)
            sent += 1
            if n == 0 and select.select([sys.stdin], [], [], 0)[0]:
                sys.stdin.readline()
                break
        print("done", flush=True)
"""


class Prober:
    """The probe loop in a child process: `run(n)` sends n probes and returns their latencies;
    `start()` probes until `stop()`, which returns theirs."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROBER, url, json.dumps(PROBE)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def _collect(self) -> list[tuple[float, float]]:
        """(start on this machine's monotonic clock, latency) of each probe."""
        assert self.proc.stdout is not None
        out = []
        for line in self.proc.stdout:
            if line.strip() == "done":
                return out
            t0, lat = line.split()
            out.append((float(t0), float(lat)))
        raise RuntimeError("the probe process ended")

    def run(self, n: int) -> list[float]:
        self._send(str(n))
        return [lat for _, lat in self._collect()]

    def start(self) -> None:
        self._send("0")

    def stop(self) -> list[tuple[float, float]]:
        self._send("x")
        return self._collect()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self._send("stop")
        self.proc.wait(60)


def measure(url: str, prober: Prober, name: str, path: str, body: dict, copies: int, settle_s: float) -> dict:
    idle = statistics.median(prober.run(5))
    results: list[tuple[int, float, str]] = []

    def send() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            t0 = time.monotonic()
            r = c.post(path, json=body)
            msg = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
            results.append((r.status_code, time.monotonic() - t0, msg[:160]))
            log(f"{name}: sent at {t0 - began:.2f}s, answered {r.status_code} after {time.monotonic() - t0:.2f}s")

    prober.start()
    began = time.monotonic()
    time.sleep(settle_s)
    senders = [threading.Thread(target=send) for _ in range(copies)]
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    time.sleep(settle_s)
    timeline = [(round(t - began, 2), round(lat, 3)) for t, lat in prober.stop()]
    lat = [x for _, x in timeline]
    worst = max(lat)
    row = {"class": name, "copies": copies, "status": [r[0] for r in results], "seconds": [round(r[1], 3) for r in results],
           "message": results[0][2], "probe_idle_s": round(idle, 4), "probe_worst_s": round(worst, 4),
           "probe_median_s": round(statistics.median(lat), 4), "probe_worst_x": round(worst / idle, 2),
           "probes": len(lat), "probe_timeline": timeline}
    log(f"{name}: {row}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--request-limits", default=None, help="passed to kvtier serve")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of probing before and after each request")
    ap.add_argument("--only", default=None, help="comma-separated class names")
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="one more kvtier serve flag (repeat it; e.g. --serve-flag=--enable-log-requests)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "hostile.json")
    args = ap.parse_args()
    flags = [*([args.model] if args.model else []), "--max-model-len", str(args.max_model_len)]
    if args.request_limits:
        flags += ["--request-limits", args.request_limits]
    flags += args.serve_flag
    srv = launch(flags, timeout=600)
    rows = []
    prober = Prober(srv.url)
    try:
        for name, path, body in classes():
            if args.only and name not in args.only.split(","):
                continue
            rows.append(measure(srv.url, prober, name, path, body, 2 if name == "prompt_7mb" else 1, args.settle))
    finally:
        prober.close()
        srv.proc.terminate()
        srv.proc.wait(60)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".log").write_text("".join(srv.lines))  # the server's side of each row
    print_table(["class", "status", "request s", "probe idle s", "probe worst s", "worst / idle"],
                [[r["class"], ",".join(map(str, r["status"])), ",".join(map(str, r["seconds"])), r["probe_idle_s"],
                  r["probe_worst_s"], r["probe_worst_x"]] for r in rows])
    write_json(args.out, {"machine": machine_info(), "flags": flags, "probe": PROBE, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
