"""`kvtier extract`'s commit record: DIR/manifest.jsonl, and the check that a hidden-state file is
complete (see server/extract.py for how a rerun uses them to resume)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.jsonl"


class LayerMismatch(ValueError):
    """DIR holds files of other layers than this run asks for."""


def check_file(path: Path, layer_ids: list[int], *, num_tokens: int | None = None,
               prompt: list[int] | None = None, max_new: int = 0) -> int | None:
    """The token count of a complete hidden-state file, or None when it is not one we can keep."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            if json.loads((f.metadata() or {}).get("layer_ids", "null")) != layer_ids:
                return None
            hs, tk = f.get_slice("hidden_states").get_shape(), f.get_slice("token_ids").get_shape()
            if len(tk) != 1 or len(hs) != 3 or hs[0] != tk[0] or hs[1] != len(layer_ids) or tk[0] < 1:
                return None
            n = int(tk[0])
            if num_tokens is not None and n != num_tokens:
                return None
            if prompt is not None:
                # The prompt, then (with --max-tokens K) at most K-1 generated tokens.
                if not len(prompt) <= n <= len(prompt) + max(max_new - 1, 0):
                    return None
                if f.get_tensor("token_ids")[: len(prompt)].tolist() != prompt:
                    return None
    except Exception:  # noqa: BLE001 - a torn, truncated or foreign file of any kind is simply recomputed
        return None
    return n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Manifest:
    """DIR/manifest.jsonl: one line per complete file, each id at most once."""

    def __init__(self, out: Path, layer_ids: list[int]) -> None:
        self.out, self.path, self.layer_ids = out, out / MANIFEST, layer_ids
        self.entries: dict[str, dict[str, Any]] = {}
        self._fd: int | None = None

    def load(self, repair: bool = True) -> None:
        """The complete entries; with `repair`, the file is rewritten without the torn, duplicated
        or stale lines (a data-parallel shard loads without: the parent repaired it, and another
        shard's append may be half-read here)."""
        from connectors.hidden_states import file_name

        if not self.path.exists():
            return
        dirty = False
        for raw in self.path.read_bytes().splitlines():
            try:
                e = json.loads(raw)
                ok = (isinstance(e, dict) and isinstance(e.get("id"), str) and isinstance(e.get("num_tokens"), int)
                      and e.get("path") == file_name(e["id"]))
            except (json.JSONDecodeError, UnicodeDecodeError):
                ok = False  # a torn last line from a kill mid-append
            if ok and e.get("layer_ids") != self.layer_ids:
                raise LayerMismatch(f"{self.out} holds files with layer ids {e.get('layer_ids')}, this run asks for "
                                  f"{self.layer_ids}: use another --output directory")
            if not ok or e["id"] in self.entries or \
                    check_file(self.out / e["path"], self.layer_ids, num_tokens=e["num_tokens"]) is None:
                dirty = True  # dropped: torn, duplicated, or its file is gone or damaged (recomputed)
                continue
            self.entries[e["id"]] = e
        if dirty and repair:
            self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.out / f".{MANIFEST}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in self.entries.values())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.out)

    def append(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        if self._fd is None:  # O_APPEND and one write(2) a batch: shards of a data-parallel run append side by side
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = "".join(json.dumps(e) + "\n" for e in entries).encode()
        if os.write(self._fd, data) != len(data):  # a full disk: the rest would tear a line
            raise OSError(f"short write to {self.path}")
        os.fsync(self._fd)
        for e in entries:
            self.entries[e["id"]] = e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
