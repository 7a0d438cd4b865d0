"""The OpenAI formats of finished and streamed choices (logprobs, usage, extras): the output side
of `server.api.API`, which mixes this in (its tokenizer is `self.tok`)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from engine.sample.prompt_logprobs import with_ranks

if TYPE_CHECKING:
    from server.api import Choice
    from server.protocol import _Sampling


class OutputFormats:
    tok: Any
    _pieces: dict[int, str]  # token id -> its text alone (at most one entry per vocabulary token)

    def piece(self, token: int) -> str:
        """`tok.decode([token])`, remembered: a response with prompt log-probs decodes each of its
        top-k alternatives at every prompt position, mostly the same few thousand tokens."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tok.decode([token])
        return text

    @staticmethod
    def usage(choices: list[Choice], n: int) -> dict[str, Any]:
        firsts = choices[::n]  # one choice per prompt: a prompt is counted once, whatever n is
        prompt = sum(len(c.prompt_ids) for c in firsts)
        out = sum(len(c.token_ids) for c in choices)
        cached = sum(c.finish.num_cached_tokens for c in firsts if c.finish is not None)
        thinking = sum(c.finish.thinking_tokens or 0 for c in choices if c.finish is not None)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": thinking}}

    def completion_logprobs(self, c: Choice, start: int = 0, text_offset: int = 0) -> dict[str, Any] | None:
        if c.finish is None and not c.logprobs:
            return None
        toks, lps, tops, offs = [], [], [], []
        off = text_offset
        for t, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self.piece(t)
            toks.append(s)
            lps.append(entry.get(t))
            tops.append({self.piece(k): v for k, v in sorted(entry.items(), key=lambda kv: -kv[1])})
            offs.append(off)
            off += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def prompt_logprobs(self, c: Choice) -> list[dict[str, Any] | None] | None:
        """vLLM's format: None for the first token, then {token id: {logprob, rank, decoded_token}}.
        Formatted once per prompt: the sequences of one prompt share their leader's (the same list)."""
        src = c.leader or c
        if src.prompt_logprobs is None:
            return None
        if src.formatted_prompt_logprobs is None:
            src.formatted_prompt_logprobs = self._format_prompt_logprobs(src.prompt_logprobs)
        return src.formatted_prompt_logprobs

    def _format_prompt_logprobs(self, raw: list[Any]) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = [None]
        for rank, lps in raw:
            entry = with_ranks((rank, {int(t): v for t, v in lps.items()}))
            out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.piece(t)}
                        for t, lp in entry.items()})
        return out

    def chat_logprobs(self, c: Choice, top: int, start: int = 0) -> dict[str, Any]:
        content = []
        for t, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]

            def item(tid: int, lp: float) -> dict[str, Any]:
                s = self.piece(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            content.append({**item(t, entry.get(t, float("-inf"))), "top_logprobs": [item(k, v) for k, v in best]})
        return {"content": content}

    def extras(self, c: Choice, req: _Sampling) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if req.return_token_ids:
            out["token_ids"] = list(c.token_ids)
            out["prompt_token_ids"] = list(c.prompt_ids)
        if c.finish is not None and c.finish.stop_reason is not None:
            out["stop_reason"] = c.finish.stop_reason
        if c.finish is not None and c.finish.thinking_forced_tokens:  # a spent thinking_token_budget
            out["thinking_forced_tokens"] = c.finish.thinking_forced_tokens
        return out

    @staticmethod
    def finish_reason(c: Choice) -> str | None:
        if c.finish is None:
            return None
        r = c.finish.finish_reason
        return {"abort": "abort", "error": "error"}.get(r, r)

    @staticmethod
    def transfer_params(choices: list[Choice]) -> dict[str, Any] | None:
        params = [c.finish.kv_transfer_params for c in choices if c.finish and c.finish.kv_transfer_params]
        if not params:
            return None
        return params[0] if len(params) == 1 else {"choices": params}


def heavy_output(req: Any) -> bool:
    """The request asked for log-probs (of its prompt or its tokens): its response may be large."""
    return getattr(req, "prompt_logprobs", None) is not None or bool(getattr(req, "logprobs", None))


def _dumps(value: Any) -> bytes:
    # JSONResponse's own settings
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


CHUNK = 64  # list items per json.dumps call in a large list
SPLIT_DEPTH = 4  # body (0) -> choices (1) -> a choice (2) -> its prompt_logprobs (3): deeper, one call per value


def encode_body(body: dict[str, Any]) -> bytes:
    """`body` as JSONResponse would render it, in pieces: each json.dumps call holds the GIL for
    its whole length, so a 35 MB body in one call froze the event loop for its whole length; a
    large list is encoded CHUNK items at a time, and once (the n sequences of one prompt share
    their prompt log-probs: the same list object). The pieces are joined once at the end: joining
    at every level copied an 80 MB body four times (0.3 s)."""
    parts: list[bytes] = []
    _encode(body, parts, {}, 0)
    return b"".join(parts)


def _encode(value: Any, parts: list[bytes], memo: dict[int, bytes], depth: int) -> None:
    if depth >= SPLIT_DEPTH or not isinstance(value, (dict, list)):
        parts.append(_dumps(value))
    elif isinstance(value, dict):
        parts.append(b"{")
        for i, (k, v) in enumerate(value.items()):
            parts.append(_dumps(k) + b":" if i == 0 else b"," + _dumps(k) + b":")
            _encode(v, parts, memo, depth + 1)
        parts.append(b"}")
    elif len(value) <= CHUNK:
        parts.append(b"[")
        for i, v in enumerate(value):
            if i:
                parts.append(b",")
            _encode(v, parts, memo, depth + 1)
        parts.append(b"]")
    else:
        if id(value) not in memo:
            memo[id(value)] = b"[" + b",".join(_dumps(value[i:i + CHUNK])[1:-1]
                                               for i in range(0, len(value), CHUNK)) + b"]"
        parts.append(memo[id(value)])


RESPONSE_THREADS = 2
_heavy_pool: ThreadPoolExecutor | None = None


async def json_response(build: Callable[[], dict[str, Any]], heavy: bool = False) -> Response:
    """A generation response, built by `build` and encoded on a worker thread: n choices with
    prompt log-probs make tens of MB of JSON from 75k formatted log-prob entries (seconds on the
    event loop, where every other request waited, issue 38). A `heavy` one (log-probs asked for)
    goes to a pool of its own, so that a few of them never take every thread the default pool has.
    Its threads keep normal priority: at nice 19, beside a busy engine core (one CPU-bound process
    per core), the thread was descheduled for long stretches while it held the GIL, so the event
    loop stalled (a probe at 0.91 s against 0.12 s idle) and the response took 17 s instead of
    1.0-1.6 s (tests/server/test_hostile_requests.py); with idle neighbours, nice 19 bought little
    (benchmarks/hostile.py, demo model, worst probe 1.8x idle against 1.9-2.0x at nice 0)."""
    global _heavy_pool
    pool = None
    if heavy:
        if _heavy_pool is None:
            _heavy_pool = ThreadPoolExecutor(RESPONSE_THREADS, "kvtier-response")
        pool = _heavy_pool
    content = await asyncio.get_running_loop().run_in_executor(pool, lambda: encode_body(build()))
    return Response(content, media_type="application/json")
