#!/usr/bin/env python3
"""Multi-turn conversation traces in Mooncake's format, for designing and testing eviction policies.

Each line is one request: `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (one id
per 512-token prompt block, prefix-chained: equal ids mean equal prefixes), as in
`../shared/traces/mooncake_synthetic.jsonl`, plus `session` and `turn` (a hint a policy may use,
as a server gets one from OpenAI's `user` field or `cache_salt`; the Mooncake trace has none).

The model (every parameter is a flag):
  * sessions arrive as a Poisson process over `--duration` seconds;
  * a session opens with one of `--system-prompts` shared system prompts, picked with Zipf skew
    `--system-zipf` (0: uniform), each `--system-tokens` long (log-normal), or with none
    (`--no-system-share` of sessions);
  * its first user message is `--first-tokens` long (log-normal: documents, code, long context);
  * its number of turns T follows a power law, P(T >= k) = k^-`--turns-alpha` (alpha 1.8:
    mean 1.88, 71% of sessions one turn, and a session that has lasted longer is likelier to go
    on: 29% after one turn, 48% after two; public chat logs look like that), or with `--turns-alpha 0` a geometric law of mean `--turns` (every
    turn equally likely to be the last); between turns the user thinks for
    `--think` seconds (log-normal, `--think-sigma`); each later turn's prompt is the previous
    prompt, the model's answer (`--output-tokens`) and a new message (`--turn-tokens`), so it
    extends the previous prompt; prompts are capped at `--max-tokens` (the session then ends);
  * with `--agent-share` > 0, that share of the system prompts are agents (tool loops): their
    sessions use `--agent-turns-alpha` and `--agent-think` instead (default off);
  * a block's id depends on its parent's id and its own tokens: a prompt's last block is partial,
    so the next turn, which fills it, has a different id for it (as a real prefix cache does).
With the defaults (seed 0) the trace has 11,896 requests, 300,707 block references, 185,609
distinct blocks and a 38.3% unbounded-cache hit rate, and LRU hits 8.3% / 25.7% / 37.7% of block
references at 4,096 / 16,384 / 65,536 blocks: the shape of the multi-turn trace issue 18 describes
(12,031 requests, 288,500 references, 182,790 distinct, 36.6%; LRU 8.8% / 26.6% / 35.9%).

    python benchmarks/traces.py --out benchmarks/results/multiturn.jsonl [--seed N] [...]
prints the trace's statistics (requests, block refs, distinct blocks, unbounded hit rate).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512


@dataclass(frozen=True)
class TraceSpec:
    duration_s: float = 3600.0
    sessions: int = 7700
    turns_alpha: float = 1.8
    turns: float = 1.65  # geometric mean, with turns_alpha 0
    think_s: float = 300.0
    think_sigma: float = 1.0
    system_prompts: int = 40
    system_zipf: float = 1.1
    system_tokens: float = 1500.0
    no_system_share: float = 0.3
    first_tokens: float = 11000.0
    turn_tokens: float = 1200.0
    output_tokens: float = 300.0
    sigma: float = 0.9  # log-normal spread of every token length
    max_tokens: int = 64000
    agent_share: float = 0.0  # share of system prompts that are agents: their own turns law and think time
    agent_turns_alpha: float = 1.5
    agent_think_s: float = 15.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("duration_s", "think_s", "system_tokens", "first_tokens", "turn_tokens", "output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.sessions < 1 or self.system_prompts < 1 or self.turns < 1 or self.max_tokens < BLOCK:
            raise ValueError("sessions, system_prompts and turns must be >= 1, max_tokens >= one block")
        if self.turns_alpha != 0 and self.turns_alpha <= 1:
            raise ValueError("turns_alpha must be 0 (geometric) or > 1 (a finite mean)")
        if not 0 <= self.no_system_share <= 1 or not 0 <= self.agent_share <= 1:
            raise ValueError("no_system_share and agent_share must be in [0, 1]")
        if self.agent_turns_alpha <= 1 or self.agent_think_s <= 0:
            raise ValueError("agent_turns_alpha must be > 1 and agent_think_s > 0")


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A log-normal draw with the given mean (not median)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


class _Ids:
    """Prefix-chained block ids: (parent id, block content) -> id, in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def chain(self, contents: list[tuple]) -> list[int]:
        out, parent = [], -1
        for c in contents:
            parent = self._ids.setdefault((parent, c), len(self._ids))
            out.append(parent)
        return out


def _blocks(system: tuple | None, sys_len: int, session: int, length: int) -> list[tuple]:
    """Content keys of a prompt's blocks: system-prompt blocks are shared; a block that holds
    session tokens is the session's; a partial last block is keyed by its token count."""
    out = []
    for i in range(math.ceil(length / BLOCK)):
        end = min((i + 1) * BLOCK, length)
        partial = end - i * BLOCK if end % BLOCK else 0
        if system is not None and end <= sys_len and not (partial and end == length and end < sys_len):
            out.append(("sys", system, i, partial))
        else:
            out.append(("s", session, i, partial))
    return out


def generate(spec: TraceSpec) -> list[dict]:
    rng = random.Random(spec.seed)
    ids = _Ids()
    weights = [1 / (k + 1) ** spec.system_zipf for k in range(spec.system_prompts)]
    cum = [sum(weights[:k + 1]) for k in range(len(weights))]
    sys_lens = [max(1, round(_lognormal(rng, spec.system_tokens, spec.sigma))) for _ in weights]
    apps = random.Random(f"{spec.seed}:apps")  # its own stream: agent_share 0 leaves the trace as it was
    agent = [apps.random() < spec.agent_share for _ in weights]
    events: list[tuple[float, int, int, int, int]] = []  # (time, session, turn, prompt length, system)
    state: dict[int, tuple[int | None, int]] = {}
    for s in range(spec.sessions):
        t0 = rng.uniform(0, spec.duration_s)
        system = None if rng.random() < spec.no_system_share else bisect.bisect_left(cum, rng.uniform(0, cum[-1]))
        sys_len = sys_lens[system] if system is not None else 0
        length = sys_len + max(1, round(_lognormal(rng, spec.first_tokens, spec.sigma)))
        state[s] = (system, sys_len)
        heapq.heappush(events, (t0, s, 0, min(length, spec.max_tokens), 0))
    def goes_on(turns_done: int, alpha: float) -> bool:
        if alpha == 0:
            return rng.random() < 1 - 1 / spec.turns
        return rng.random() < (turns_done / (turns_done + 1)) ** alpha  # P(T > k | T >= k)

    out = []
    while events:
        t, s, turn, length, _ = heapq.heappop(events)
        if t > spec.duration_s:
            continue
        system, sys_len = state[s]
        answer = max(1, round(_lognormal(rng, spec.output_tokens, spec.sigma)))
        hash_ids = ids.chain(_blocks(system, sys_len, s, length))
        out.append({"timestamp": round(t * 1000), "input_length": length, "output_length": answer,
                    "hash_ids": hash_ids, "session": s, "turn": turn})
        nxt = length + answer + max(1, round(_lognormal(rng, spec.turn_tokens, spec.sigma)))
        is_agent = system is not None and agent[system]
        alpha, think = (spec.agent_turns_alpha, spec.agent_think_s) if is_agent else (spec.turns_alpha, spec.think_s)
        if goes_on(turn + 1, alpha) and nxt <= spec.max_tokens:
            heapq.heappush(events, (t + _lognormal(rng, think, spec.think_sigma), s, turn + 1, nxt, 0))
    return out


def unbounded_hit_rate(trace: list[list[int]]) -> float:
    """Prefix hits over block references with a cache that never evicts."""
    seen: set[int] = set()
    hits = refs = 0
    for ids in trace:
        refs += len(ids)
        for b in ids:
            if b not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits / refs if refs else 0.0


def stats(trace: list[list[int]]) -> dict:
    return {"requests": len(trace), "block_refs": sum(map(len, trace)),
            "distinct_blocks": len({b for ids in trace for b in ids}), "unbounded_hit_rate": unbounded_hit_rate(trace)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    d = TraceSpec()
    for flag, name, help_ in [
            ("--duration", "duration_s", "trace length in seconds"), ("--sessions", "sessions", "sessions in the trace"),
            ("--turns-alpha", "turns_alpha", "power-law exponent of turns per session; 0: geometric"),
            ("--turns", "turns", "mean turns per session with --turns-alpha 0"),
            ("--think", "think_s", "mean think time between turns, s"),
            ("--think-sigma", "think_sigma", "log-normal sigma of think times"),
            ("--system-prompts", "system_prompts", "shared system prompts"),
            ("--system-zipf", "system_zipf", "Zipf exponent of system-prompt popularity"),
            ("--system-tokens", "system_tokens", "mean system-prompt length"),
            ("--no-system-share", "no_system_share", "share of sessions without a shared system prompt"),
            ("--first-tokens", "first_tokens", "mean first-message length"),
            ("--turn-tokens", "turn_tokens", "mean new-message length of later turns"),
            ("--output-tokens", "output_tokens", "mean answer length"),
            ("--sigma", "sigma", "log-normal sigma of token lengths"),
            ("--max-tokens", "max_tokens", "longest prompt; a session ends there"),
            ("--agent-share", "agent_share", "share of system prompts that are agents (tool loops)"),
            ("--agent-turns-alpha", "agent_turns_alpha", "power-law exponent of an agent session's turns"),
            ("--agent-think", "agent_think_s", "mean seconds between an agent's turns (its tools)"),
            ("--seed", "seed", "random seed")]:
        default = getattr(d, name)
        ap.add_argument(flag, dest=name, type=type(default), default=default, help=f"{help_} (default: %(default)s)")
    ns = ap.parse_args(argv)
    try:
        spec = TraceSpec(**{k: v for k, v in vars(ns).items() if k != "out"})
    except ValueError as e:
        ap.error(str(e))
    trace = generate(spec)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    with ns.out.open("w") as f:
        for r in trace:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({**stats([r["hash_ids"] for r in trace]), "out": str(ns.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
