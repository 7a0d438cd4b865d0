"""The OpenAI formats of finished and streamed choices (logprobs, usage, extras): the output side
of `server.api.API`, which mixes this in (its tokenizer is `self.tok`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.prompt_logprobs import with_ranks

if TYPE_CHECKING:
    from server.api import Choice
    from server.protocol import _Sampling


class OutputFormats:
    tok: Any

    @staticmethod
    def usage(choices: list[Choice], n: int) -> dict[str, Any]:
        firsts = choices[::n]  # one choice per prompt: a prompt is counted once, whatever n is
        prompt = sum(len(c.prompt_ids) for c in firsts)
        out = sum(len(c.token_ids) for c in choices)
        cached = sum((c.finish or {}).get("num_cached_tokens", 0) for c in firsts)
        thinking = sum((c.finish or {}).get("thinking_tokens", 0) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": thinking}}

    def completion_logprobs(self, c: Choice, start: int = 0, text_offset: int = 0) -> dict[str, Any] | None:
        if c.finish is None and not c.logprobs:
            return None
        toks, lps, tops, offs = [], [], [], []
        off = text_offset
        for t, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self.tok.decode([t])
            toks.append(s)
            lps.append(entry.get(t))
            tops.append({self.tok.decode([k]): v for k, v in sorted(entry.items(), key=lambda kv: -kv[1])})
            offs.append(off)
            off += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def prompt_logprobs(self, c: Choice) -> list[dict[str, Any] | None] | None:
        """vLLM's format: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
        if c.prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for rank, lps in c.prompt_logprobs:
            entry = with_ranks((rank, {int(t): v for t, v in lps.items()}))
            out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.tok.decode([t])}
                        for t, lp in entry.items()})
        return out

    def chat_logprobs(self, c: Choice, top: int, start: int = 0) -> dict[str, Any]:
        content = []
        for t, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]

            def item(tid: int, lp: float) -> dict[str, Any]:
                s = self.tok.decode([tid])
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            content.append({**item(t, entry.get(t, float("-inf"))), "top_logprobs": [item(k, v) for k, v in best]})
        return {"content": content}

    def extras(self, c: Choice, req: _Sampling) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if req.return_token_ids:
            out["token_ids"] = list(c.token_ids)
            out["prompt_token_ids"] = list(c.prompt_ids)
        if c.finish is not None and c.finish.get("stop_reason") is not None:
            out["stop_reason"] = c.finish["stop_reason"]
        if c.finish is not None and c.finish.get("thinking_forced_tokens"):  # a spent thinking_token_budget
            out["thinking_forced_tokens"] = c.finish["thinking_forced_tokens"]
        return out

    @staticmethod
    def finish_reason(c: Choice) -> str | None:
        if c.finish is None:
            return None
        r = c.finish["finish_reason"]
        return {"abort": "abort", "error": "error"}.get(r, r)

    @staticmethod
    def transfer_params(choices: list[Choice]) -> dict[str, Any] | None:
        params = [c.finish.get("kv_transfer_params") for c in choices if c.finish and c.finish.get("kv_transfer_params")]
        if not params:
            return None
        return params[0] if len(params) == 1 else {"choices": params}
