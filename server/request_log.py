"""vLLM's --enable-log-requests: one INFO line per submitted sequence with its id, sampling
parameters and prompt (length and token ids, cut to --max-log-len). Off by default: prompts are
the users' data, and a busy server would write a line per request."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from engine.sampling_params import SamplingParams

log = logging.getLogger("kvtier.requests")


@dataclass(frozen=True)
class RequestLogger:
    max_log_len: int | None = None  # prompt token ids shown per line; None: all of them

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0; got {self.max_log_len}")

    def log(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        shown = prompt_ids if self.max_log_len is None else prompt_ids[:self.max_log_len]
        more = f" ... ({len(prompt_ids) - len(shown)} more)" if len(shown) < len(prompt_ids) else ""
        # Only the parameters that differ from SamplingParams' defaults: a full repr is ~30 fields.
        set_ = {f.name: getattr(params, f.name) for f in fields(params)
                if f.repr and getattr(params, f.name) != f.default}
        log.info("Received request %s: prompt_tokens=%d, params: %s, prompt_token_ids: %s%s", request_id,
                 len(prompt_ids), set_, shown, more)
