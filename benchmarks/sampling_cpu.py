"""A sampled decode step's token draw on the CPU: kvtier's sampler against the exponential race.

Per case (rows x vocabulary, temperature 0.8, optionally top-k or top-p), alternated rounds in one
process, medians reported:
- `race`: the filtered distribution drawn by argmax(p / E), E ~ Exp(1) per entry: what vLLM's
  `random_sample` runs (and kvtier did before engine/sample/draw.py);
- `host`: kvtier's Sampler, one row at a time (`batch_on_device=False`, the CPU default until
  2026-12-01);
- `batched`: kvtier's Sampler with the rows drawn together (engine/sample/batched.py), a few rows
  at a time on the CPU: the default.
All three include the same filtering (temperature, top-k/top-p, softmax); `race` filters as vLLM
does (a full sort for top-p). The 49,152-token rows are the demo model's next-token logits over this repository's README
(`--logits demo`, the default: real distributions, which decide how much of a row top-p reads);
other vocabularies are random. Runs under tcmalloc as `kvtier` does.

    .venv/bin/python benchmarks/sampling_cpu.py --out docs/results/sampling-cpu.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import log, median, preload_allocator, print_table, set_torch_threads, write_json  # noqa: E402

CASES = ((1, 49152, {}), (8, 49152, {}), (64, 49152, {}), (256, 49152, {}), (64, 49152, {"top_k": 50}),
         (64, 49152, {"top_p": 0.9}), (64, 151936, {}), (256, 8, {}))


def demo_logits(n: int):
    """`[n, 49152]`: the demo model's next-token logits at the first n positions of README.md."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.demo.demo_model import ensure_demo_model

    path = ensure_demo_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok((Path(__file__).resolve().parents[1] / "README.md").read_text(), return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise SystemExit(f"README.md has {ids.shape[1]} tokens; {n} needed")
    with torch.no_grad():
        return model(ids).logits[0].float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per case (default %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="calls per round (default %(default)s)")
    ap.add_argument("--logits", choices=("demo", "random"), default="demo",
                    help="the 49,152-token rows: the demo model's over README.md, or random (default %(default)s)")
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args()
    preload_allocator()
    import torch

    from engine.core.request import Request, RequestId
    from engine.sample.logit_controls import BadWords
    from engine.sample.sampler import Sampler
    from engine.sampling_params import SamplingParams

    set_torch_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    def race(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """vLLM's CPU sampling: the filter with a full sort for top-p, then the race (a case's rows
        share their settings)."""
        p = reqs[0].params
        rows = logits / p.temperature
        if p.top_k > 0:
            rows = rows.masked_fill(rows < rows.topk(p.top_k, dim=1).values[:, -1:], float("-inf"))
        probs = torch.softmax(rows, dim=1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=1, descending=True)
            drop = (sorted_p.cumsum(1) - sorted_p) >= p.top_p
            drop[:, 0] = False
            probs = probs.scatter(1, idx, sorted_p.masked_fill(drop, 0.0))
        q = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / q).argmax(dim=1).tolist()

    demo = demo_logits(max(r for r, v, _ in CASES if v == 49152)) if args.logits == "demo" else None
    rows_out = []
    for rows, vocab, kw in CASES:
        logits = demo[:rows].clone() if demo is not None and vocab == 49152 else torch.randn(rows, vocab, generator=gen) * 3
        reqs = [Request(RequestId(str(i)), [1, 2, 3], SamplingParams(temperature=0.8, **kw), max_total_tokens=64,
                        bad_word_ids=BadWords(())) for i in range(rows)]
        fns = {"race": lambda: race(logits, reqs), "host": lambda: Sampler(0, batch_on_device=False)(logits, reqs),
               "batched": lambda: Sampler(0, batch_on_device=True)(logits, reqs)}
        times: dict[str, list[float]] = {n: [] for n in fns}
        for fn in fns.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.reps * 1e3)
        med = {n: median(v) for n, v in times.items()}
        case = f"{rows} x {vocab}" + "".join(f", {k}={v}" for k, v in kw.items())
        rows_out.append({"case": case, "rows": rows, "vocab": vocab, **kw, "ms": med, "runs_ms": times})
        log(f"{case}: " + ", ".join(f"{n} {m:.2f} ms" for n, m in med.items()))
    print_table(["case", "race ms", "host ms", "batched ms", "race / batched", "host / batched"],
                [[r["case"], r["ms"]["race"], r["ms"]["host"], r["ms"]["batched"],
                  f"{r['ms']['race'] / r['ms']['batched']:.2f}x", f"{r['ms']['host'] / r['ms']['batched']:.2f}x"]
                 for r in rows_out])
    if args.out is not None:
        write_json(args.out, {"benchmark": "sampling_cpu", "threads": args.threads, "logits": args.logits,
                              "cases": rows_out})
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
