"""OpenAI request bodies (plus vLLM's extensions), validated with pydantic, and their mapping
onto `SamplingParams`. Fields these models do not declare are checked by `server.fields` before
validation (refused by name unless harmless), so `extra="ignore"` here never drops one silently."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from connectors.pd import parse as parse_pd
from engine.mm.images import template_parts
from engine.sample.prompt_logprobs import MAX_PROMPT_LOGPROBS
from engine.sampling_params import SamplingParams
from engine.sample.structured import StructuredOutputsParams
from server.fields import unsupported

MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Integers the core receives travel as msgpack int64: bigger ones are a 400, not a failed send.
I64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format json_schema needs its json_schema (and only that type takes one)")
        return self


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1, lt=2**63)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    min_tokens: int = Field(default=0, ge=0, lt=2**63)
    ignore_eos: bool = False
    stop_token_ids: list[I64] | None = None
    skip_special_tokens: bool = True
    # OpenAI's: token id (a string key in JSON) -> bias in [-100, 100]; vLLM's two extensions
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[I64] | None = None
    bad_words: list[str] | None = None
    # Structured outputs (engine/sample/structured.py): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* names; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: log-probs of the prompt's tokens (engine/sample/prompt_logprobs.py)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)
    # vLLM's: tokens a reasoning model may think before the end marker is forced (engine/sample/thinking.py)
    thinking_token_budget: int | None = Field(default=None, ge=0, lt=2**31)
    priority: I64 = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI's: a conversation's key; the tiers' eviction policies see it (BlockInfo.session), so
    # turn_lru can keep conversations that come back. It never changes the tokens.
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    user: str | None = Field(default=None, max_length=1024)  # the hint when prompt_cache_key is absent
    return_token_ids: bool = False
    # vLLM's: names the request (and its hidden-state file); sequences get "-k" suffixes when
    # a request has several (n > 1 or several prompts). Default: a random id.
    request_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,128}$")
    # vLLM's prefill/decode disaggregation (connectors/pd.py): its shape checked here (so render
    # refuses what generation refuses), whether this engine can play the role in the engine
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("kv_transfer_params")
    @classmethod
    def _pd_shape(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        parse_pd(v)
        return v

    @model_validator(mode="after")
    def _check(self) -> _Sampling:
        if isinstance(self.stop, list) and (len(self.stop) > 16 or any(not s for s in self.stop)):
            raise ValueError("stop must be at most 16 non-empty strings")
        if self.stop == "":
            raise ValueError("stop must be non-empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if len(self._structured_sources()) > 1:
            raise ValueError(f"give one of {self._structured_sources()}, not several")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= 2**63 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias maps token ids to biases in [-100, 100]; got {key!r}: {bias}")
        return self

    # A constraint set by the server for the request's tool_choice (server/tools.py), if any.
    _tool_constraint: StructuredOutputsParams | None = PrivateAttr(default=None)
    # The constraint as server/limits.py checked it (a JSON schema's canonical text), once checked.
    _checked: tuple[str, StructuredOutputsParams] | None = PrivateAttr(default=None)

    def constrain(self, tool_constraint: StructuredOutputsParams | None = None,
                  checked: tuple[str, StructuredOutputsParams] | None = None) -> None:
        """The server's additions: the constraint its tool_choice sets; the constraint as checked."""
        if tool_constraint is not None:
            self._tool_constraint, self._checked = tool_constraint, None
        if checked is not None:
            self._checked = checked

    def _structured_sources(self) -> list[str]:
        names = ["structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
        given = [n for n in names if getattr(self, n) is not None]
        given += ["response_format"] if self.response_format and self.response_format.type != "text" else []
        return given + (["tool_choice"] if self._tool_constraint is not None else [])

    def structured(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the constraint), or None; ValueError for a malformed one."""
        if self._checked is not None:
            return self._checked
        given = self._structured_sources()
        if not given:
            return None
        field = given[0]
        if field == "tool_choice":
            return field, self._tool_constraint  # type: ignore[return-value]
        if field == "response_format":
            rf = self.response_format
            assert rf is not None
            if rf.type == "json_object":
                return field, StructuredOutputsParams(json_object=True)
            return field, StructuredOutputsParams(json=rf.json_schema.schema_)  # type: ignore[union-attr]
        if field == "structured_outputs":
            return field, StructuredOutputsParams.coerce(self.structured_outputs)  # type: ignore[return-value]
        return field, StructuredOutputsParams(**{field.removeprefix("guided_"): getattr(self, field)})

    # The output limit when the request gives none; None: up to the context length.
    default_max_tokens: ClassVar[int | None] = None

    def _limit(self) -> int | None:
        return self.max_tokens

    def _n_logprobs(self) -> int | None:
        return None

    def sampling_params(self, room: int, index: int = 0) -> SamplingParams:
        """Raises ValueError for values the engine rejects. `room` is what the context has left
        after the prompt; `index` offsets the seed for n > 1, and only the first sequence of a
        prompt computes its prompt log-probs (they are the prompt's: the API copies them to the
        others, which then read the prompt's KV from the prefix cache instead of recomputing it)."""
        default = room if self.default_max_tokens is None else min(self.default_max_tokens, room)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=None if self.seed is None else (self.seed + index) % 2**63,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self._limit() or default,
            min_tokens=self.min_tokens,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self._n_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            structured_outputs=so[1] if (so := self.structured()) else None,
            thinking_token_budget=self.thinking_token_budget,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
        )


class CompletionRequest(_Sampling):
    # OpenAI's and vLLM's default when max_tokens is absent (chat's is "up to the context length").
    default_max_tokens: ClassVar[int | None] = 16
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (it must equal n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def _n_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # passed to the chat template, which may render it
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, passed to the template
    tool_call_id: str | None = None  # a tool message's answer to that call
    # An assistant's earlier thinking (interleaved thinking): templates read `reasoning_content`.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict) and (bad := unsupported(data, set(cls.model_fields))) is not None:
            raise ValueError(f"unsupported message field {bad[0]!r}: {bad[1]}")
        return data

    @model_validator(mode="after")
    def _check_calls(self) -> ChatMessage:
        for call in self.tool_calls or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError('each tool_calls entry needs {"function": {"name": ..., "arguments": ...}}')
        return self

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") != "text" for p in self.content)

    def as_dict(self, media: bool = False) -> dict[str, Any]:
        """What the chat template sees. `media` (a model that takes images): content parts stay a
        list, each image as {"type": "image"} where the template puts the model's image marker
        (server/media.py checks the parts and loads the images)."""
        content: Any = self.text() if not (media and self.has_media) else \
            template_parts(self.content)[0]  # type: ignore[arg-type]
        m: dict[str, Any] = {"role": self.role, "content": content}
        for k in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, k) is not None:
                m[k] = getattr(self, k)
        if self.reasoning is not None and self.reasoning_content is None:
            m["reasoning_content"] = self.reasoning
        return m

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part type {part.get('type')!r} is not supported: this model takes text only")
            parts.append(part["text"])
        return "".join(parts)


def check_continuation(req: Any) -> None:
    """vLLM's rule: continue_final_message continues the last message, which must be the
    assistant's, and excludes a new generation prompt (left unset, add_generation_prompt is
    then false; set true, the request is refused)."""
    if not req.continue_final_message:
        return
    if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
        raise ValueError("continue_final_message cannot be combined with add_generation_prompt true")
    req.add_generation_prompt = False
    convs = req.messages if req.messages and isinstance(req.messages[0], list) else [req.messages or []]
    if any(not conv or conv[-1].role != "assistant" for conv in convs):
        raise ValueError("continue_final_message needs the last message to be the assistant's")


class _Chat(_Sampling):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's: the last (assistant) message is left open and the model continues it
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(default=None, min_length=1)  # only with --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None  # server/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's; as vLLM, a chat-template variable (templates such as gpt-oss's read it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: false drops the reasoning a --reasoning-parser splits off from the response
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> _Chat:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        check_continuation(self)
        return self

    def _limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatCompletionRequest(_Chat):
    messages: list[ChatMessage] = Field(min_length=1)


class BatchChatCompletionRequest(_Chat):
    """`/v1/chat/completions/batch`: `messages` is a list of conversations, answered together;
    choice i answers conversation i (times n: choice i*n + j is its j-th sample)."""
    messages: list[list[ChatMessage]] = Field(min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _no_stream(self) -> BatchChatCompletionRequest:
        if self.stream:
            raise ValueError("the batch endpoint does not stream")
        if any(not c for c in self.messages):
            raise ValueError("every conversation needs at least one message")
        return self


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(default=None, min_length=1)  # only with --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None  # server/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        check_continuation(self)
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
