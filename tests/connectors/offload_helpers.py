"""Shared helpers for the tiered-offload acceptance tests (tests/connectors/test_offload_*.py).

The oracle everywhere is the same engine with offload OFF and prefix caching OFF (every
prompt token recomputed), which must itself equal transformers' greedy tokens on prompts
whose greedy steps all have a clear top-1/top-2 margin (checked once per prompt set, so a
mismatch later points at the offload path, not at a float near-tie).

Offload blocks are OB tokens (a multiple of G1's block size 16). A prompt's last token is
always recomputed, so a prompt of n tokens can get at most ``hit_tokens(n)`` tokens from
the offload tiers: its full offload blocks, less the last token when the last block is full.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import signal
from collections.abc import Sequence
from pathlib import Path

from checkpoints import MIN_REL_MARGIN, hf_greedy, load_hf, random_prompt, relative_margin
from engine import LLM, SamplingParams

KIND = "qwen3"
OB = 64  # offload block size (tokens) used by these tests
MAX_TOKENS = 8
# G1 of 100 blocks (1600 tokens) holds the three workload prompts at once (94 blocks with
# their outputs: concurrent loads never compete for G1, see test_offload_nonblocking for
# what happens when they do) but not a flush prompt as well.
G1_BLOCKS = 100
FLUSH_LEN = 1590  # with MAX_TOKENS, needs all 100 G1 blocks: every cached G1 block is evicted

# Lengths chosen so that each prompt has a partial last offload block (the hit cap matters)
# and one prompt is exactly on an offload boundary + 1 (640 + 1: the cap is then 640).
LENGTHS = (300, 520, 641)
SEEDS = (7101, 7102, 7103)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def workload(lengths: Sequence[int] = LENGTHS, seeds: Sequence[int] = SEEDS) -> list[list[int]]:
    return [random_prompt(n, s) for n, s in zip(lengths, seeds)]


def as_inputs(prompts: Sequence[Sequence[int]]) -> list[dict]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def hit_tokens(n: int, ob: int = OB) -> int:
    """Most tokens an offload tier can supply for an n-token prompt with nothing in G1."""
    return min(n // ob * ob, n - 1)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def run(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS):
    return llm.generate(as_inputs(prompts), greedy(max_tokens), use_tqdm=False)


def flush_g1(llm: LLM, seed: int = 9999, length: int = FLUSH_LEN) -> None:
    """Run a prompt that needs every G1 block (evicting all cached prefixes), then wait for
    queued offload stores so the tiers below are settled."""
    run(llm, [random_prompt(length, seed)])
    llm.engine.connector.flush()


def offload_llm(model_dir: Path | str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks", G1_BLOCKS)
    kw.setdefault("kv_offload_block_size", OB)
    return LLM(str(model_dir), **kw)


def encoded_block_bytes(model_dir: Path | str, ob: int = OB, itemsize: int = 4) -> int:
    """Bytes of one encoded offload block (codec header + KV) of a checkpoint."""
    import json

    from connectors.codec import HEADER_BYTES

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return HEADER_BYTES + cfg["num_hidden_layers"] * 2 * ob * cfg["num_key_value_heads"] * head_dim * itemsize


def g2_gib(model_dir: Path | str, slots: int, ob: int = OB) -> float:
    """kv_offloading_size (GiB) that gives G2 exactly `slots` offload blocks."""
    return (slots + 0.5) * encoded_block_bytes(model_dir, ob) / 2**30


def check_integrity(llm: LLM) -> None:
    """Every invariant check the engine and its tiers expose."""
    llm.engine.check_integrity()
    conn = llm.engine.connector
    if conn is not None:
        if getattr(conn, "g2", None) is not None:
            conn.g2.check_integrity()
        for tier in getattr(conn, "tiers", ()):
            if hasattr(tier.backend, "check_integrity"):
                tier.backend.check_integrity()
        if hasattr(conn, "check_integrity"):
            conn.check_integrity()


@functools.lru_cache(maxsize=None)
def _reference(model_dir: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int, dtype: str) -> tuple:
    llm = LLM(model_dir, dtype=dtype, enable_prefix_caching=False, num_gpu_blocks=256)
    try:
        assert type(llm.engine.connector).__name__ == "NullConnector"
        outs = run(llm, prompts, max_tokens)
        assert all(o.num_cached_tokens == 0 for o in outs)
        return tuple(tuple(t) for t in tokens(outs))
    finally:
        llm.close()
        del llm
        gc.collect()


@functools.lru_cache(maxsize=None)
def _check_margins(model_dir: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int, ref: tuple) -> None:
    """transformers agrees with the offload-off engine and has no near-tie on any step."""
    model = load_hf(Path(model_dir))
    for p, want in zip(prompts, ref):
        toks, scores = hf_greedy(model, p, max_tokens, return_scores=True)
        assert tuple(toks) == want, "offload-off engine differs from transformers: fix the engine first"
        worst = min(relative_margin(s) for s in scores)
        assert worst > MIN_REL_MARGIN, f"near-tie ({worst:.1e}) in the oracle: pick other prompt seeds"
    del model
    gc.collect()


def reference(model_dir: Path | str, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS,
              dtype: str = "float32", check_hf: bool = True) -> list[list[int]]:
    """Greedy tokens with offload off (and no prefix caching): the oracle. Memoized."""
    key = tuple(tuple(p) for p in prompts)
    ref = _reference(str(model_dir), key, max_tokens, dtype)
    if check_hf and dtype == "float32":
        _check_margins(str(model_dir), key, max_tokens, ref)
    return [list(t) for t in ref]


def load_kinds(outs) -> list[dict[str, int]]:
    return [dict(o.cached_tokens_by_tier) for o in outs]


class EngineStuck(AssertionError):
    """generate() did not return in time: the engine livelocked or hung."""


@contextlib.contextmanager
def deadline(seconds: float, what: str = "generate"):
    """Raise EngineStuck in the main thread after `seconds` (LLM.generate then aborts its
    pending requests), so a livelocked engine fails the test instead of hanging the run."""

    def _alarm(signum, frame):
        raise EngineStuck(f"{what} did not finish within {seconds:.0f} s (engine livelock or hang)")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def reads_through_get_into(backend) -> None:
    """Routes a backend's whole-load reads (`get_into_batch`, G3's one native call per load into
    G1) through its `get_into`, so a test that replaces `get_into` to inject a fault or a delay
    sees every read."""
    from kvstore.backend import ScatterReads

    backend.get_into_batch = functools.partial(ScatterReads.get_into_batch, backend)
