"""--enable-log-requests: one INFO line per finished sequence (its id, prompt tokens, cached tokens by
tier, output tokens, finish reason, TTFT and latency), and with --log-prompts also one when it
arrives, with its sampling parameters and prompt token ids (cut to --max-log-len). Off by default:
a busy server would write a line per request, and prompts are the users' data."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields as dc_fields

from engine.sampling_params import SamplingParams
from server.logs import fields

log = logging.getLogger("kvtier.requests")


@dataclass(frozen=True)
class RequestLogger:
    max_log_len: int | None = None  # prompt token ids shown per line; None: all of them
    log_prompts: bool = False

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0; got {self.max_log_len}")

    def received(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not self.log_prompts:
            return
        shown = prompt_ids if self.max_log_len is None else prompt_ids[:self.max_log_len]
        more = f" ... ({len(prompt_ids) - len(shown)} more)" if len(shown) < len(prompt_ids) else ""
        # Only the parameters that differ from SamplingParams' defaults: a full repr is ~30 fields.
        set_ = {f.name: getattr(params, f.name) for f in dc_fields(params)
                if f.repr and getattr(params, f.name) != f.default}
        log.info("Received request %s: prompt_tokens=%d, params: %s, prompt_token_ids: %s%s", request_id,
                 len(prompt_ids), set_, shown, more,
                 extra=fields(request_id=request_id, prompt_tokens=len(prompt_ids), prompt_token_ids=shown))

    def finished(self, request_id: str, prompt_tokens: int, cached_by_tier: dict[str, int], output_tokens: int,
                 finish_reason: str, ttft_s: float | None, latency_s: float) -> None:
        cached = sum(cached_by_tier.values())
        by_tier = " ".join(f"{t}={n}" for t, n in sorted(cached_by_tier.items()) if n) or "none"
        ttft = "-" if ttft_s is None else f"{ttft_s:.3f}s"
        log.info("Finished request %s: prompt_tokens=%d cached_tokens=%d (%s) output_tokens=%d finish_reason=%s "
                 "ttft=%s latency=%.3fs", request_id, prompt_tokens, cached, by_tier, output_tokens, finish_reason,
                 ttft, latency_s,
                 extra=fields(request_id=request_id, prompt_tokens=prompt_tokens, cached_tokens=cached,
                              cached_tokens_by_tier=dict(cached_by_tier), output_tokens=output_tokens,
                              finish_reason=finish_reason, ttft_s=ttft_s, latency_s=latency_s))
