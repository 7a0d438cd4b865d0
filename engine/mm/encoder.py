"""The vision encoder's outputs, kept by image digest (runner side): a repeated image whose
prompt's KV is not cached (a new question after it, a prefix evicted) is not encoded again, and a
prompt chunked inside an image's neighbourhood encodes it once.

Bounded by bytes, least recently used out first, in host memory (a hit is copied to the device:
1.3 MB for a Gemma 3 image in bfloat16). Only the runner's thread reads and writes it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from engine.mm.inputs import MMItem

log = logging.getLogger(__name__)

DEFAULT_BYTES = 512 * 2**20  # a Gemma 3 image is 256 x 2560 floats (2.6 MB in float32): ~190 of them


class EncoderCache:
    def __init__(self, encode: Callable[[Sequence[MMItem]], Sequence[torch.Tensor]],
                 max_bytes: int = DEFAULT_BYTES) -> None:
        """`encode`: items whose pixels have one shape -> each one's `[tokens, hidden]` embeddings."""
        if max_bytes < 0:
            raise ValueError(f"encoder cache size must be >= 0 bytes; got {max_bytes}")
        self._encode, self.max_bytes = encode, max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def features(self, items: Sequence[MMItem]) -> list[torch.Tensor]:
        """Each item's `[length, hidden]` embeddings; the ones not kept are encoded in one batch
        per pixel shape. ValueError if the encoder gives another number of tokens than an item's
        placeholders."""
        out: dict[bytes, torch.Tensor] = {}
        todo: dict[bytes, MMItem] = {}
        for it in items:
            got = self._entries.get(it.digest)
            if got is not None:
                self._entries.move_to_end(it.digest)
                self.hits += 1
                out[it.digest] = got
            elif it.digest not in todo:
                self.misses += 1
                todo[it.digest] = it
        by_shape: dict[tuple[int, ...], list[MMItem]] = {}
        for it in todo.values():
            by_shape.setdefault(tuple(it.pixels.shape), []).append(it)
        for group in by_shape.values():
            embs = self._encode(group)
            for it, emb in zip(group, embs):
                if emb.shape[0] != it.length:
                    raise ValueError(f"the encoder gave {emb.shape[0]} embeddings for an image with {it.length} "
                                     "placeholder tokens")
                out[it.digest] = emb
                self._keep(it.digest, emb.cpu())  # host memory: on a GPU, G1 sizing never counted it
        return [out[it.digest] for it in items]

    def stats(self) -> dict[str, int]:
        """Hits and misses by item, and the bytes held (EngineStats.encoder_cache)."""
        return {"hits": self.hits, "misses": self.misses, "bytes": self.bytes, "max_bytes": self.max_bytes,
                "entries": len(self._entries)}

    def _keep(self, digest: bytes, emb: torch.Tensor) -> None:
        size = emb.numel() * emb.element_size()
        if size > self.max_bytes:
            return
        self._entries[digest] = emb
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def check_integrity(self) -> None:
        total = sum(e.numel() * e.element_size() for e in self._entries.values())
        if total != self.bytes or self.bytes > self.max_bytes:
            raise AssertionError(f"encoder cache holds {total} bytes, counts {self.bytes} (max {self.max_bytes})")
