#!/usr/bin/env python3
"""Speculative decoding on the demo model: output tokens/s with speculation off and on.

Workloads (chat template, greedy, each prompt's output capped at --max-tokens):
  grounded   "rewrite/correct this text" requests: the answer copies most of its input, where
             prompt lookup (ngram) should pay off.
  chat       open-ended questions: the answer copies little, where proposals are mostly wasted
             verify work, and speculation must not cost much.
Batch sizes: 1 (one request at a time, the latency case) and --batch (all requests at once).

Engines are LLM instances in this process, built once: `off` (no speculation) and one per
--spec JSON (name=JSON, e.g. ngram='{"method": "ngram", ...}'), and with --async each of them
again with async scheduling (`off+async`, `ngram+async`). Runs are interleaved (off,
ngram, ..., off, ...); each cell is the median over --runs of output tokens / wall time. A fresh
cache_salt per run keeps prefix caching from serving run 2 what run 1 computed. Greedy outputs
are compared with `off`'s: a mismatch is reported (speculation must not change them).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import RESULTS_DIR, log, median, print_table, run_interleaved, set_torch_threads, usable_cpus, write_json  # noqa: E402
from _plots import plot_file  # noqa: E402

TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more then two hundred years. Every night its "
    "keeper climbed the one hundred and twelve steps to light the lamp, and every morning he wrote the "
    "weather, the ships he had seen and the state of the sea in a thick leather book. When the keeper "
    "retired, the town decided to keep the light burning with an electric lamp, but nobody wanted to "
    "write in the book, so it sat on a shelf in the library, where children still read it on rainy days.",
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven "
    "grams of dry yeast. Add three hundred and fifty milliliters of warm water and stir untill the dough "
    "comes together. Knead it for ten minutes, then leave it in a warm place for one hour, or until it "
    "has doubled in size. Shape the loaf, let it rise for another thirty minutes, and bake it at two "
    "hundred and twenty degrees for about thirty five minutes, until the crust is deep brown.",
    "Our team meeting is moved from Tuesday to Thursday at ten in the morning. Please bring the project "
    "plan, the list of open questions and your estimates for the next three weeks. We will review the "
    "budget first, then the schedule, and finally the risks that were raised last month. If you cannot "
    "attend, send your notes to the project lead before Wednesday evening, so that they can be discussed "
    "in the meeting. The meeting room is on the second floor, next to the kitchen.",
    "The river starts as a small stream in the mountains, fed by snow that melts every spring. It runs "
    "through a narrow valley, past three villages and an old mill, before it reaches the plain. There it "
    "becomes wide and slow, and farmers use its water to grow wheat, corn and vegetables. In the autumn "
    "the river floods the low fields, leaving a layer of rich soil behind, and in the winter it freezes "
    "along the banks, so that the children of the villages can skate on it.",
]
GROUNDED_TASKS = [
    "Rewrite the following text exactly, correcting any spelling mistakes:\n\n{}",
    "Copy the following text, changing nothing except the spelling errors:\n\n{}",
]
CHAT = [
    "Tell me a short story about a dragon who learns to cook.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe your ideal weekend in a few sentences.",
    "Why is the sky blue? Explain it to a ten year old.",
    "Write a poem about the sea.",
    "Give me some tips for learning a new language.",
    "What would you pack for a week-long camping trip?",
    "Explain how a bicycle works.",
]


def workload(name: str, n: int) -> list[list[dict[str, str]]]:
    if name == "grounded":
        return [[{"role": "user", "content": GROUNDED_TASKS[i % 2].format(TEXTS[i % len(TEXTS)])}] for i in range(n)]
    return [[{"role": "user", "content": CHAT[i % len(CHAT)]}] for i in range(n)]


def measure(llm, chats: list, batch: int, max_tokens: int, salt: str) -> dict[str, Any]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)} for c in chats]
    before = llm.get_stats().spec_decode
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False, cache_salt=salt)
    wall = time.perf_counter() - start
    after = llm.get_stats().spec_decode
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"tok_s": n_out / wall, "output_tokens": n_out, "wall_s": wall,
           "tokens": [o.outputs[0].token_ids for o in outs]}
    if after is not None:
        drafts = after["num_drafts"] - before["num_drafts"]
        acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
        res.update(acceptance_rate=acc / proposed if proposed else 0.0,
                   mean_acceptance_length=1 + acc / drafts if drafts else 1.0,
                   draft_share=drafts / max(1, n_out))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--spec", action="append", default=[], metavar="NAME=JSON",
                   help="a speculative engine (repeatable); default: ngram with k=3, lookup 2..4")
    p.add_argument("--workloads", default="grounded,chat", help="comma-separated: grounded, chat (default: %(default)s)")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="also run each engine with --async-scheduling (NAME+async); speedups stay vs `off`")
    p.add_argument("--batch", type=int, default=16, help="the batched size (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16, help="requests per workload (default: %(default)s)")
    p.add_argument("--batch1-requests", type=int, default=4, help="requests at batch 1 (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="output cap per request (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; cells are medians (default: %(default)s)")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all usable CPUs)")
    p.add_argument("--out", default=str(RESULTS_DIR / "spec_decode.json"), help="JSON results (default: %(default)s)")
    args = p.parse_args()
    specs = {"off": None}
    for item in args.spec or ['ngram={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                              '"prompt_lookup_max": 4}']:
        name, sep, js = item.partition("=")
        if not sep or name == "off":
            p.error(f"--spec wants NAME=JSON with NAME other than 'off'; got {item!r}")
        try:
            specs[name] = json.loads(js)
        except json.JSONDecodeError as e:
            p.error(f"--spec {name}: {e}")
    workloads = args.workloads.split(",")
    if set(workloads) - {"grounded", "chat"}:
        p.error(f"--workloads: unknown {sorted(set(workloads) - {'grounded', 'chat'})}")
    set_torch_threads(args.threads)
    from engine import LLM

    engines = {}
    for name, spec in specs.items():
        for asynchronous in (False, True) if args.asynchronous else (False,):
            label = name + ("+async" if asynchronous else "")
            log(f"loading {label}")
            engines[label] = LLM(args.model, max_num_seqs=max(args.batch, 1), speculative_config=spec,
                                 async_scheduling=asynchronous)
    cases = [(w, b) for w in workloads for b in (1, args.batch)]
    rows, results = [], {}
    for w, b in cases:
        chats = workload(w, args.batch1_requests if b == 1 else args.requests)
        for llm in engines.values():  # warm-up: compiled graphs, kernels, allocator
            measure(llm, chats[:1], 1, 8, "warm")
        got = run_interleaved(args.runs, {n: (lambda r, llm=llm: measure(llm, chats, b, args.max_tokens,
                                                                           f"{w}-{b}-{r}-{time.time()}"))
                                          for n, llm in engines.items()},
                              progress=lambda r, n, res: log(f"{w} batch {b} run {r} {n}: {res['tok_s']:.1f} tok/s"))
        ref = got["off"][0]["tokens"]
        base = median([x["tok_s"] for x in got["off"]])
        for name, runs in got.items():
            tok_s = median([x["tok_s"] for x in runs])
            same = all(x["tokens"] == ref for x in runs)
            acc = median([x.get("mean_acceptance_length", 1.0) for x in runs])
            rows.append([w, b, name, tok_s, round(tok_s / base, 2), round(acc, 2), "yes" if same else "NO"])
            results[f"{w}/{b}/{name}"] = {"tok_s": [x["tok_s"] for x in runs], "median_tok_s": tok_s,
                                          "vs_off": tok_s / base, "identical_to_off": same,
                                          **{k: median([x[k] for x in runs]) for k in
                                             ("acceptance_rate", "mean_acceptance_length", "draft_share")
                                             if k in runs[0]}}
    for llm in engines.values():
        llm.close()
    print_table(["workload", "batch", "engine", "output tok/s", "vs off", "mean accepted len", "same tokens"], rows)
    path = write_json(args.out, {"benchmark": "spec_decode", "specs": specs, "args": vars(args), "results": results})
    log(f"wrote {path}")
    plot_file(path)


if __name__ == "__main__":
    main()
