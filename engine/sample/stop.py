"""When a request stops: a stop token or string, or its token limit."""
from __future__ import annotations

from collections.abc import Callable

from engine.core.request import Request, RequestStatus


def detokenize(tokenizer, req: Request) -> str:
    """A request's output text so far (what stop strings are matched against)."""
    return tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)


def check_stop(req: Request, eos_token_ids: frozenset[int], detokenize: Callable[[Request], str]
               ) -> RequestStatus | None:
    """The finish status after the request's last appended token, or None to go on. A stop
    string also sets `output_text` (cut before it) and `stop_reason`."""
    token = req.output_token_ids[-1]
    n_out = len(req.output_token_ids)
    if token in req.stop_ids and n_out > req.params.min_tokens:
        req.stop_with(token if token not in eos_token_ids else None)
        return RequestStatus.FINISHED_STOPPED
    if req.params.stop and n_out > req.params.min_tokens:
        # Decode the whole output: simple and exact across token boundaries; outputs are short.
        text = detokenize(req)
        for s in req.params.stop:
            at = text.find(s)
            if at >= 0:
                req.stop_with(s, text[:at])
                return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_tokens(req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None,
                  eos_token_ids: frozenset[int], detokenize: Callable[[Request], str]
                  ) -> tuple[RequestStatus | str | None, int]:
    """Appends `tokens` one at a time, checking stop conditions after each, as if each came from
    its own step. Returns the finish status (or why checking failed) and how many were kept."""
    for i, token in enumerate(tokens):
        req.append_token(token, logprobs[i] if logprobs is not None else None)
        try:
            status = check_stop(req, eos_token_ids, detokenize)
        except (ValueError, TypeError, IndexError, OverflowError) as e:  # e.g. the tokenizer on its output
            return f"checking stop conditions failed: {type(e).__name__}: {e}", i + 1
        if status is not None:
            return status, i + 1
    return None, len(tokens)
