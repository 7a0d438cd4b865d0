"""Default sampling parameters from a model's `generation_config.json` (vLLM's --generation-config).

`auto` (the default) reads the model directory's file, `vllm` ignores it, and any other value is a
directory holding one. As in vLLM, the keys used are temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (the default max_tokens), and only values that differ from
transformers' own defaults count (vLLM reads the file through `GenerationConfig.to_diff_dict()`),
so a file that merely restates `top_k: 50` changes nothing. `do_sample` is ignored, as in vLLM.

A default applies to a request only where the request leaves the field unset (or null): a field
the request sets wins. max_new_tokens is the limit of requests that give none (chat; completions
keep OpenAI's 16, vLLM's field default), never above what the context has left; read from a
directory given by path it also caps every request, as vLLM's `override_max_tokens` does.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
# The request fields a generation config may default, and transformers' GenerationConfig defaults
# for them: a value equal to these is not a "diff" and does not count.
_FIELDS: dict[str, float | int | None] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                          "repetition_penalty": 1.0}
_LIMITS = ("max_tokens", "max_completion_tokens")  # the request fields a max_new_tokens default stands in for


@dataclass(frozen=True)
class SamplingDefaults:
    """What a generation config sets; ValueError for values SamplingParams refuses."""

    values: tuple[tuple[str, float | int], ...] = ()  # (request field, default), in _FIELDS' order
    max_tokens: int | None = None  # max_new_tokens: the limit of requests that give none
    cap: bool = False  # --generation-config DIR: max_tokens also caps requests that give one
    source: str = ""  # the file, for the start-up line and errors

    def __post_init__(self) -> None:
        unknown = sorted({k for k, _ in self.values} - set(_FIELDS))
        if unknown:
            raise ValueError(f"{self.source}: unsupported sampling fields {unknown}")
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens < 1):
            raise ValueError(f"{self.source}: max_new_tokens must be a positive integer; got {self.max_tokens!r}")
        try:
            SamplingParams(**dict(self.values))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.source}: {e}") from None

    def __bool__(self) -> bool:
        return bool(self.values) or self.max_tokens is not None

    @classmethod
    def load(cls, mode: str, model_dir: Path) -> SamplingDefaults:
        """The defaults `--generation-config MODE` gives for `model_dir` (empty for `vllm`, or when
        the file has no sampling fields); ValueError naming the flag for a missing directory or a
        malformed file."""
        if mode == "vllm":
            return cls()
        folder = model_dir if mode == "auto" else Path(mode)
        if not folder.is_dir():
            raise ValueError(f"--generation-config {mode}: not a directory (give auto, vllm or a directory "
                             f"holding {GENERATION_CONFIG})")
        path = folder / GENERATION_CONFIG
        if not path.is_file():
            if mode != "auto":
                raise ValueError(f"--generation-config {mode}: no {GENERATION_CONFIG} there")
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--generation-config: {path} is not a JSON object")
        values = tuple((k, raw[k]) for k in _FIELDS if raw.get(k) is not None and raw[k] != _FIELDS[k])
        for k, v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"--generation-config: {path}: {k} must be a number; got {v!r}")
        return cls(values, raw.get("max_new_tokens"), cap=mode != "auto", source=str(path))

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.values]
        if self.max_tokens is not None:
            parts.append(f"max_tokens={self.max_tokens}" + (" (also a cap)" if self.cap else ""))
        return ", ".join(parts)

    def log_startup(self) -> None:
        """vLLM's line, so an operator knows why unset fields do not get OpenAI's defaults."""
        if self:
            log.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                        "config (%s): %s. Requests that set a field keep their value; relaunch with "
                        "--generation-config vllm to ignore the file.", self.source, self.describe())

    def apply(self, req: Any, params: SamplingParams) -> SamplingParams:
        """`params` (built from the pydantic request `req`) with the defaults of the fields `req`
        leaves unset or null."""
        given = req.model_fields_set
        changes: dict[str, Any] = {k: v for k, v in self.values if k not in given or getattr(req, k, None) is None}
        if self.max_tokens is not None:
            unlimited = all(getattr(req, k, None) is None for k in _LIMITS)
            # Chat's limit when none is given is the context's room (params.max_tokens); completions
            # have a field default (16) of their own, which the file does not replace.
            if (unlimited and type(req).default_max_tokens is None) or self.cap:
                changes["max_tokens"] = min(self.max_tokens, params.max_tokens or self.max_tokens)
        return replace(params, **changes) if changes else params
