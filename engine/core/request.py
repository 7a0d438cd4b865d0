"""A request's state as the scheduler and the model runner see it (bookkeeping, no tensors)."""
from __future__ import annotations

import enum
import time
from typing import NewType

import torch

from connectors.pd import PDRequest
from engine.sample.logit_controls import NO_BAD_WORDS, BadWords
from engine.lora.registry import AdapterRef
from kvstore.events import LoRATag
from engine.mm.inputs import MMInputs
from engine.sampling_params import SamplingParams
from engine.sample.prompt_logprobs import PromptLogprob
from engine.sample.structured import GrammarState
from engine.sample.thinking import ThinkingTracker
from kvstore.keys import BlockKey, extend_keys

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prefix is loading from a lower tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        session: str | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        max_total_tokens: int,
        bad_word_ids: BadWords = NO_BAD_WORDS,
        grammar: GrammarState | None = None,
        thinking: ThinkingTracker | None = None,
        pd: PDRequest | None = None,
        mm: MMInputs | None = None,
        lora: AdapterRef | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.bad_word_ids = bad_word_ids  # params.bad_words tokenized (engine/sample/logit_controls.py)
        self.grammar = grammar  # params.structured_outputs' matcher (engine/sample/structured.py)
        self.thinking = thinking  # the thinking section and its budget (engine/sample/thinking.py)
        self.priority = priority
        self.cache_salt = cache_salt
        self.session = session  # the client's conversation hint (prompt_cache_key or user), for eviction policies
        self.pd = pd  # prefill/decode disaggregation: this request's role (connectors/pd.py)
        self.mm = mm  # its images (engine/mm/inputs.py): their digests enter the block keys
        self.lora = lora  # its LoRA adapter (engine/lora/registry.py): its digest enters the first block's key
        self.lora_tag = LoRATag.of(lora.name, lora.digest) if lora is not None else None  # as KV events name it
        self.arrival_time = time.monotonic()
        # For the per-phase latencies (queue, prefill) the server exports: set once, on this clock.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.block_keys: list[BlockKey] = []  # keys of this request's full blocks, grown lazily
        self.stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else eos_token_ids)
        limit = max_total_tokens - len(prompt_token_ids)
        self.max_output_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Entry i is prompt token i + 1's (engine/sample/prompt_logprobs.py).
        self.prompt_logprobs: list[PromptLogprob] | None = [] if params.prompt_logprobs is not None else None
        self.first_logits: torch.Tensor | None = None
        self.output_text = ""
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.kv_transfer_params: dict | None = None  # what the connectors returned at finish
        self.pending_external_tokens = 0  # tokens an async load is bringing into G1
        self.preempted = False
        self.load_failed = False  # an offload load failed: recompute instead of asking again
        self.abort_requested = False  # aborted while loading: finished once the load lands
        # Prompt tokens not computed, by the tier that supplied them ("G1", "G2", "G3", "G4").
        self.cached_by_tier: dict[str, int] = {}
        # Speculative decoding: tokens proposed for the next step (not part of the sequence yet),
        # and the draft's distributions they were drawn from ([k, vocab]; None: a point mass).
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        # Async scheduling: tokens of this request in steps launched but not yet updated, and
        # the tokens those steps will sample (their ids are not known when the next step is
        # planned). Both stay 0 in the synchronous engine.
        self.num_inflight_tokens = 0
        self.num_output_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose KV is computed or being computed by a launched step."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    # After admission only these methods and the scheduler write a request (issue 40;
    # tests/engine/test_request_writers.py checks it by running).
    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def advance(self, tokens: int) -> None:
        """`tokens` more have their KV computed (a prompt chunk, or a step's committed tokens)."""
        self.num_computed_tokens += tokens

    def mark_in_flight(self, sign: int, tokens: int, placeholders: int) -> None:
        """Async scheduling: a step with `tokens` of this request, sampling `placeholders` of
        them, was planned (+1) or applied (-1)."""
        self.num_inflight_tokens += sign * tokens
        self.num_output_placeholders += sign * placeholders

    def stop_with(self, reason: int | str | None, text: str | None = None) -> None:
        """A stop token (its id; None for EOS) or string ended it; `text`: the output cut before
        the stop string."""
        self.stop_reason = reason
        if text is not None:
            self.output_text = text

    def full_block_keys(self, block_size: int) -> list[BlockKey]:
        """The keys of its full blocks so far, computed once each (chained: a key names the block
        and everything before it). Read-only for callers."""
        media = None if self.mm is None else (lambda i: self.mm.block_extra(i, block_size))  # type: ignore[union-attr]
        extend_keys(self.block_keys, self.all_token_ids, block_size, self.cache_salt, media,
                    self.lora.digest if self.lora is not None else b"")
        return self.block_keys

    def fail(self, why: str) -> None:
        self.error = why

    def request_abort(self) -> None:
        """Aborted while its KV loads: finished once the load lands."""
        self.abort_requested = True

    def keep_first_logits(self, logits: torch.Tensor) -> None:
        self.first_logits = logits

    def set_transfer_params(self, params: dict | None) -> None:
        """What the connectors returned at finish (`kv_transfer_params` of the response)."""
        self.kv_transfer_params = params

    def set_proposal(self, token_ids: list[int], probs: torch.Tensor | None) -> None:
        """Speculative decoding: the tokens proposed for the next step and their draft distributions."""
        self.spec_token_ids, self.spec_probs = token_ids, probs

    def take_proposal(self, k: int) -> tuple[int, ...]:
        """Its first `k` proposals, handed to a planned step; the rest are dropped."""
        spec, self.spec_token_ids = tuple(self.spec_token_ids[:k]), []
        return spec

    def take_proposal_probs(self) -> torch.Tensor | None:
        """The draft distributions, once: verification consumes them."""
        probs, self.spec_probs = self.spec_probs, None
        return probs

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probs are not all in: computed tokens are not read from a cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def add_prompt_logprobs(self, first_position: int, entries: list[PromptLogprob]) -> None:
        """Entries from `first_position` on; those already in (a recomputed prompt) are skipped."""
        assert self.prompt_logprobs is not None
        skip = len(self.prompt_logprobs) - first_position
        if skip >= 0:
            self.prompt_logprobs += entries[skip:]

    def active_grammar(self) -> GrammarState | None:
        """The grammar while it applies: structured outputs constrain the answer, not a thinking
        section (nor the end marker a budget forces)."""
        if self.thinking is not None and not self.thinking.answering:
            return None
        return self.grammar

    def num_output_suppressed(self, num_pending: int = 0) -> bool:
        """True while min_tokens forbids the stop tokens (`num_pending` more tokens in)."""
        return len(self.output_token_ids) + num_pending < self.params.min_tokens and bool(self.stop_ids)

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower priority value first, then earlier arrival (as in vLLM)."""
        return (self.priority, self.arrival_time)
