"""`--reasoning-parser`: a reasoning model's thinking text goes to `reasoning_content` (and
`reasoning`, the name vLLM moved to; clients read one or the other), the rest to `content`.

The parsers work on text, so markers that tokenize to several tokens, or arrive split across
stream deltas, are found all the same: a stream holds back the end of a delta that could be
the beginning of the marker it waits for. Only the first thinking section is split off; what
follows its end marker is content, as in vLLM.

- `deepseek_r1`: the output starts inside the thinking section (R1's template opens it, and the
  model may repeat `<think>`); without an end marker everything is reasoning.
- `qwen3`: the output starts inside it only when the prompt opened it (Qwen3's thinking models
  and `enable_thinking` templates); otherwise a `<think>` in the output opens it, and text with
  no marker is all content.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.sample.thinking import ReasoningConfig


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    always_opens: bool  # the output begins inside the thinking section whatever the prompt

    def config(self) -> ReasoningConfig:
        """The engine's markers for this parser (thinking_token_budget needs them)."""
        return ReasoningConfig(self.start, self.end)

    def stream(self, prompt_opened: bool) -> ReasoningStream:
        return ReasoningStream(self, self.always_opens or prompt_opened)

    def split(self, text: str, prompt_opened: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is absent."""
        s = self.stream(prompt_opened)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = r1 + r2, c1 + c2
        return (reasoning if s.saw_reasoning else None), (content or None)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>", always_opens=True),
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>", always_opens=False),
}


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _until(buf: str, marker: str) -> tuple[str, str, bool]:
    """(the text before `marker`, the text after it, True); without the marker, (what can be
    passed on, the end held back as a possible beginning of it, False)."""
    at = buf.find(marker)
    if at >= 0:
        return buf[:at], buf[at + len(marker):], True
    keep = _held(buf, marker)
    return buf[:len(buf) - keep], buf[len(buf) - keep:], False


class ReasoningStream:
    """Splits one output's text deltas into (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.p = parser
        # "maybe-start": inside thinking, where a leading start marker is dropped; "thinking";
        # "answer-or-start": before any thinking, where a start marker opens it; "content".
        self.state = "maybe-start" if opened else "answer-or-start"
        self.saw_reasoning = opened
        self._buf = ""  # held back: may be the beginning of a marker

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._buf + text
        while buf:
            if self.state == "maybe-start":
                stripped = buf.lstrip()
                if len(stripped) < len(self.p.start) and self.p.start.startswith(stripped):
                    break  # could still be the (repeated) start marker
                if stripped.startswith(self.p.start):
                    buf = stripped[len(self.p.start):]
                self.state = "thinking"
            elif self.state == "thinking":
                before, buf, found = _until(buf, self.p.end)
                reasoning.append(before)
                if not found:
                    break
                self.state = "content"
            elif self.state == "answer-or-start":
                before, buf, found = _until(buf, self.p.start)
                content.append(before)
                if not found:
                    break
                self.state, self.saw_reasoning = "thinking", True
            else:
                content.append(buf)
                buf = ""
        self._buf = buf
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        buf, self._buf = self._buf, ""
        return (buf, "") if self.state in ("maybe-start", "thinking") else ("", buf)


def prompt_opens(prompt_ids: list[int], start_ids: list[int], end_ids: list[int]) -> bool:
    """Whether the prompt leaves a thinking section open (its last start marker after its last
    end marker), as the engine's tracker decides."""
    from engine.sample.thinking import Markers, ThinkingTracker

    return not ThinkingTracker(Markers(tuple(start_ids), tuple(end_ids)), None, prompt_ids).answering
