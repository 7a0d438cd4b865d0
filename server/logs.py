"""How `kvtier serve` logs, in both of its processes: vLLM-like text lines, or one JSON object per
line (`--log-format json`) for log shippers.

A line that carries numbers an operator may want to query (the per-request line, the periodic
stats line) passes them with `fields(...)`; the JSON format puts them at the top level of the
object, the text format leaves them out (its message already says them in words).

JSON object keys: `time` (ISO 8601, UTC, milliseconds), `level`, `process` (`api` or `core`),
`logger`, `message`, the line's fields, and `exception` (the formatted traceback) when there is one.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
_FIELDS = "kvtier_fields"  # the LogRecord attribute `fields()` sets
_TEXT = {"api": "%(asctime)s %(levelname)s %(name)s: %(message)s",
         "core": "%(asctime)s %(levelname)s core %(name)s: %(message)s"}


def fields(**values: Any) -> dict[str, Any]:
    """`log.info(msg, *args, extra=fields(k=v, ...))`: structured values for the JSON format."""
    return {_FIELDS: values}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "process": self.process, "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in (getattr(record, _FIELDS, None) or {}).items():
            out.setdefault(k, v)  # a field never overwrites the keys above
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


@dataclass(frozen=True)
class LogSettings:
    """--log-level and --log-format; picklable, so the engine core process gets the same."""

    level: str = "info"
    format: str = "text"

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {self.level!r}")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}; got {self.format!r}")

    def configure(self, process: str) -> None:
        """Replaces the root logger's handlers with one writing to stderr in this format."""
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(process) if self.format == "json" else logging.Formatter(_TEXT[process]))
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.addHandler(handler)
        root.setLevel(self.level.upper())
        logging.captureWarnings(True)  # Python warnings become records too, in the same format
