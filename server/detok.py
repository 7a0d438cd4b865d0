"""Incremental detokenization for streaming, in the API process.

Decoding token by token splits multi-byte characters and merges spaces wrongly, so each step
decodes a short window that starts a few tokens back and emits only text past what the window
already produced. Text is held back while it ends in an incomplete character, or while it could
still be the start of a stop string (which the engine will cut)."""
from __future__ import annotations

from typing import Any

WINDOW = 6  # tokens of left context; enough for any merge rule seen in BPE tokenizers


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: list[str] | None = None) -> None:
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far that is certain
        self.emitted = 0  # characters of self.text already returned
        self.prefix_offset = 0
        self.read_offset = 0
        self.hold = max((len(s) for s in stop or ()), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: list[int]) -> str:
        """Returns the text that is safe to show after these tokens."""
        for t in new_ids:
            self.ids.append(t)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = max(len(self.ids) - WINDOW, 0), len(self.ids)
        safe = len(self.text) - self.hold
        if safe <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:safe], safe
        return out

    def finish(self, final_text: str) -> str:
        """The rest, given the final text (stop strings already cut). Held-back text never
        contained a whole stop string, so what was emitted is a prefix of the final text."""
        rest = final_text[self.emitted:] if final_text.startswith(self.text[:self.emitted]) else ""
        self.emitted = len(final_text)
        return rest
