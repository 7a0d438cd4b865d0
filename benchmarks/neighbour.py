"""Issue 38, acceptance 5: how much does one busy neighbour (a `while True: pass` process on the
same cores) slow the CPU engine, against vLLM's CPU build under the same neighbour?

Offline workload (the issue's): 8 requests of 64 random prompt tokens and 32 greedy output
tokens, then one 512-token prefill. Each engine runs in a worker process of its own (vLLM in its
venv, ../shared/PEERS.md) with every usable core; rounds are interleaved (kvtier quiet, kvtier
with the neighbour, vLLM quiet, vLLM with the neighbour, ...; the engine not running is
SIGSTOPped) and the best of each is kept.
Serve: a 40-token greedy chat through `kvtier serve` on the demo model, quiet and with the
neighbour (target: within 3x).

    .venv/bin/python benchmarks/neighbour.py --vllm-python /tmp/vllmvenv/bin/python \\
        --vllm-env LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/tmp/vllmvenv/lib/libiomp5.so

Writes benchmarks/results/neighbour.json. kvtier runs as the `kvtier` CLI would: under tcmalloc
when the system has it, with its thread governor on (--no-adaptive compares it off).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_WORKER = len(sys.argv) > 1 and sys.argv[1] == "--_worker"
if not _WORKER:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import (RESULTS_DIR, JsonWorker, log, machine_info, print_table, usable_cpus,  # noqa: E402
                     vllm_cpu_env, worker_reply, write_json)

SEED_IDS = 1000  # random ids drawn from [SEED_IDS, 40000): ordinary tokens of the demo vocabulary


def workload(seed: int) -> tuple[list[list[int]], list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(SEED_IDS, 40000) for _ in range(64)] for _ in range(8)], \
        [rng.randrange(SEED_IDS, 40000) for _ in range(512)]


def worker(engine: str, model: str, adaptive: bool, reply_fd: int) -> None:
    """In the engine's own venv: load once, then time the workload on each 'run'."""
    send = worker_reply(reply_fd)
    try:
        if engine == "vllm":
            from vllm import LLM, SamplingParams

            llm = LLM(model=model, dtype="float32", seed=0)
        else:
            sys.path.insert(0, str(_HERE.parent))
            from engine import LLM, SamplingParams

            llm = LLM(model, dtype="float32", adaptive_cpu_threads=adaptive)
        decode = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        prefill = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([{"prompt_token_ids": list(range(SEED_IDS, SEED_IDS + 16))}] * 2, decode, use_tqdm=False)
        send(ready=True)
        n = 0
        for cmd in sys.stdin:
            if cmd.strip() != "run":
                break
            n += 1
            prompts, long = workload(n)  # new ids every run: nothing from the prefix cache
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], decode, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate([{"prompt_token_ids": long}], prefill, use_tqdm=False)
            t2 = time.perf_counter()
            assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
            send(decode_s=t1 - t0, prefill_s=t2 - t1, total_s=t2 - t0)
    except BaseException as e:
        send(error=f"{type(e).__name__}: {e}")
        raise


class Hog:
    def __enter__(self) -> Hog:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)  # the governor measures over 0.5 s intervals
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
        time.sleep(1.5)  # and comes back after two quiet ones


def offline(args: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    engines: dict[str, JsonWorker] = {}
    me = str(Path(__file__).resolve())
    env = dict(os.environ, PYTHONPATH=str(_HERE.parent))
    from engine.runner.cpu_runtime import reexec_env

    kv_env = reexec_env(env) or env  # tcmalloc, as the kvtier CLI runs
    engines["kvtier"] = JsonWorker([sys.executable, me, "--_worker", "kvtier", model, str(not args.no_adaptive)],
                                   kv_env, tmp, name="kvtier")
    if args.vllm_python:
        engines["vllm"] = JsonWorker([args.vllm_python, me, "--_worker", "vllm", model, "True"],
                                     vllm_cpu_env(args.threads, 2.0, tmp, args.vllm_env), tmp, name="vllm")
    for name, w in engines.items():
        w.recv(900)
        log(f"{name} ready")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {n: {"quiet": [], "neighbour": []} for n in engines}
    try:
        for r in range(args.rounds):
            for name, w in engines.items():
                # The other engine's workers stopped meanwhile: an idle vLLM still used CPU here,
                # which made kvtier's governor see a neighbour in its quiet runs.
                others = [o for n, o in engines.items() if n != name]
                for o in others:
                    os.killpg(o.proc.pid, signal.SIGSTOP)
                w.send("run")
                runs[name]["quiet"].append(w.recv(900))
                with Hog():
                    w.send("run")
                    runs[name]["neighbour"].append(w.recv(1800))
                for o in others:
                    os.killpg(o.proc.pid, signal.SIGCONT)
                log(f"round {r + 1} {name}: quiet {runs[name]['quiet'][-1]['total_s']:.2f} s, "
                    f"neighbour {runs[name]['neighbour'][-1]['total_s']:.2f} s")
    finally:
        for w in engines.values():
            w.close()
    out = {}
    for name, cond in runs.items():
        best = {c: {k: min(x[k] for x in v) for k in ("decode_s", "prefill_s", "total_s")} for c, v in cond.items()}
        out[name] = {**best, "slowdown": best["neighbour"]["total_s"] / best["quiet"]["total_s"],
                     "prefill_slowdown": best["neighbour"]["prefill_s"] / best["quiet"]["prefill_s"], "runs": cond}
    return out


def serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from server.launch import launch

    srv = launch(["--max-model-len", "2048", *([] if not args.no_adaptive else ["--no-adaptive-cpu-threads"])],
                 timeout=600)
    body = {"messages": [{"role": "user", "content": "Tell me about the history of Paris."}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    times: dict[str, list[float]] = {"quiet": [], "neighbour": []}
    try:
        with httpx.Client(base_url=srv.url, timeout=900) as c:
            c.post("/v1/chat/completions", json=body).raise_for_status()
            for _ in range(args.rounds):
                for cond in ("quiet", "neighbour"):
                    if cond == "neighbour":
                        hog = Hog().__enter__()
                    t0 = time.monotonic()
                    c.post("/v1/chat/completions", json=body).raise_for_status()
                    times[cond].append(time.monotonic() - t0)
                    if cond == "neighbour":
                        hog.__exit__()
                log(f"serve: quiet {times['quiet'][-1]:.2f} s, neighbour {times['neighbour'][-1]:.2f} s")
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)
    governor = [ln.strip() for ln in srv.lines if "forward threads" in ln]
    return {"quiet_s": min(times["quiet"]), "neighbour_s": min(times["neighbour"]), "worst_neighbour_s": max(times["neighbour"]),
            "slowdown": min(times["neighbour"]) / min(times["quiet"]), "runs": times, "governor_log": governor[-6:]}


def main() -> int:
    if _WORKER:
        worker(sys.argv[2], sys.argv[3], sys.argv[4] == "True", int(sys.argv[-1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per engine and condition (default 2)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="vLLM's bound threads (default: usable cores)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (../shared/PEERS.md)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="for vLLM's worker (repeat)")
    ap.add_argument("--no-adaptive", action="store_true", help="kvtier without its thread governor")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "neighbour.json")
    args = ap.parse_args()
    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    with tempfile.TemporaryDirectory(prefix="kvtier-neighbour-") as tmp:
        off = offline(args, args.model, Path(tmp))
    rows = [[name, f"{r['quiet']['total_s']:.2f}", f"{r['neighbour']['total_s']:.2f}", f"{r['slowdown']:.2f}x",
             f"{r['prefill_slowdown']:.2f}x"] for name, r in off.items()]
    print_table(["engine", "quiet s", "neighbour s", "slowdown", "512-token prefill slowdown"], rows)
    sv = None if args.skip_serve else serve(args)
    if sv is not None:
        print_table(["kvtier serve, 40-token chat", "quiet s", "neighbour s (best)", "neighbour s (worst)", "slowdown"],
                    [["", f"{sv['quiet_s']:.2f}", f"{sv['neighbour_s']:.2f}", f"{sv['worst_neighbour_s']:.2f}",
                      f"{sv['slowdown']:.2f}x"]])
    write_json(args.out, {"machine": machine_info(), "adaptive": not args.no_adaptive, "offline": off, "serve": sv,
                          "vllm_env": args.vllm_env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
