"""Encoded offload blocks: a small header (layout, token digest) in front of raw KV bytes.

Every tier below G1 stores the encoded form, so a block read from anywhere carries what is
needed to refuse it: a layout mismatch (another model, dtype or block geometry) or a token
digest mismatch (a key collision) reads as a miss.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAGIC = b"KVBK"
VERSION = 1
_HEADER = struct.Struct("<4sHH16s16sQ")  # magic, version, reserved, layout id, token digest, payload bytes
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class BlockLayout:
    """Geometry of one offload block: `[num_layers, 2, g1_blocks, block_size, kv_heads, head_dim]`."""

    num_layers: int
    g1_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    fingerprint: str  # model identity (architecture, config, weights) the KV belongs to
    # Exported hidden states carried after the KV, `[g1_blocks, block_size, len(ids), hidden_size]`
    # (hidden-state export on); part of the layout id, so blocks without them never match.
    hidden_layer_ids: tuple[int, ...] = ()
    hidden_size: int = 0
    # The hidden states' dtype when it is not the KV's (--kv-cache-dtype: the KV is stored in
    # another dtype than the model's, the hidden states are not). None: `dtype`.
    hidden_dtype: torch.dtype | None = None
    # --kv-offload-dtype: G1's KV dtype when entries hold a narrower `dtype` (None: the same), and
    # per cache slot the (k, v) scales an fp8 entry's values are divided by (empty: none).
    g1_dtype: torch.dtype | None = None
    kv_scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kv_scales and len(self.kv_scales) != self.num_layers:
            raise ValueError(f"kv_scales needs one (k, v) pair per cache slot ({self.num_layers})")
        if self.hidden_layer_ids and self.kv_bytes % self.hidden_element.itemsize:
            raise ValueError(f"KV bytes per block ({self.kv_bytes}) must be a multiple of the hidden states' "
                             f"element size ({self.hidden_element.itemsize}) to view them in place")

    @property
    def hidden_element(self) -> torch.dtype:
        return self.hidden_dtype or self.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.g1_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def hidden_shape(self) -> tuple[int, ...]:
        return (self.g1_blocks, self.block_size, len(self.hidden_layer_ids), self.hidden_size)

    @property
    def kv_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @property
    def tokens(self) -> int:
        return self.g1_blocks * self.block_size

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.hidden_shape:
            n *= d
        return self.kv_bytes + (n * self.hidden_element.itemsize if self.hidden_layer_ids else 0)

    @property
    def encoded_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @property
    def converts(self) -> bool:
        """Whether entries hold G1's KV in another (narrower) dtype."""
        return self.g1_dtype is not None and self.g1_dtype != self.dtype

    def decode_factors(self, like: torch.Tensor) -> torch.Tensor:
        """The scales as `[slots, 2, 1, ...]`, broadcasting over `like`'s blocks."""
        f = torch.tensor(self.kv_scales, dtype=torch.float32, device=like.device)
        return f.view(*f.shape, *([1] * (like.dim() - 2)))

    def encode(self, g1: torch.Tensor) -> torch.Tensor:
        """G1 blocks `[slots, 2, n, ...]` as an entry's KV: in `dtype`, divided by the scales and
        saturated for fp8 (the scales are powers of two: exact)."""
        if not self.kv_scales:
            return g1.to(self.dtype)
        big = torch.finfo(self.dtype).max
        return (g1.float() / self.decode_factors(g1)).clamp_(-big, big).to(self.dtype)

    def decode(self, entry: torch.Tensor) -> torch.Tensor:
        """An entry's KV `[slots, 2, n, ...]` back in G1's dtype (exact: fp8 and bfloat16 values
        are G1's, and the scales powers of two)."""
        out = entry.to(self.g1_dtype or self.dtype)
        return out.mul_(self.decode_factors(out)) if self.kv_scales else out

    def layout_id(self) -> bytes:
        desc: dict[str, Any] = {"shape": self.shape, "dtype": str(self.dtype), "fp": self.fingerprint, "v": VERSION}
        if self.hidden_layer_ids:
            desc["hidden"] = [list(self.hidden_layer_ids), self.hidden_size]
            if self.hidden_element != self.dtype:  # absent otherwise: existing layout ids are unchanged
                desc["hidden_dtype"] = str(self.hidden_element)
        if self.kv_scales:  # absent otherwise, as above
            desc["kv_scales"] = [list(x) for x in self.kv_scales]
        return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()[:16]


def header_bytes(layout_id: bytes, token_digest: bytes, payload_bytes: int) -> bytes:
    """The header an entry of this layout, token digest and size starts with."""
    return _HEADER.pack(MAGIC, VERSION, 0, layout_id, token_digest, payload_bytes)


def write_header(buf: torch.Tensor, layout_id: bytes, token_digest: bytes, payload_bytes: int) -> None:
    """Writes the header into the first HEADER_BYTES of the uint8 tensor `buf`."""
    raw = header_bytes(layout_id, token_digest, payload_bytes)
    buf[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def check_header(buf: torch.Tensor | np.ndarray, layout_id: bytes, token_digest: bytes,
                 payload_bytes: int) -> str | None:
    """None if the header at the start of `buf` (uint8) matches what the reader expects, else the
    reason it does not."""
    raw = buf[:HEADER_BYTES].tobytes() if isinstance(buf, np.ndarray) else bytes(buf[:HEADER_BYTES].numpy())
    if raw == header_bytes(layout_id, token_digest, payload_bytes):
        return None  # the usual case, in one comparison (a load checks hundreds of these)
    magic, version, _, lid, digest, n = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return "bad magic or version"
    if lid != layout_id:
        return "layout mismatch (another model, dtype or block geometry)"
    if digest != token_digest:
        return "token digest mismatch (key collision)"
    if n != payload_bytes:
        return "payload size mismatch"
    return None


def payload(buf: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The KV view `[L, 2, g1_blocks, block_size, kv_heads, head_dim]` of an encoded uint8 buffer."""
    return buf[HEADER_BYTES:HEADER_BYTES + layout.kv_bytes].view(layout.dtype).view(layout.shape)


def hidden_payload(buf: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The hidden-state view `[g1_blocks, block_size, len(ids), hidden]` after the KV."""
    return buf[HEADER_BYTES + layout.kv_bytes:HEADER_BYTES + layout.payload_bytes].view(layout.hidden_element).view(
        layout.hidden_shape)


def encode_blocks(buf: torch.Tensor, layout: BlockLayout, kv_cache: torch.Tensor, hidden_cache: torch.Tensor | None,
                  blocks: list[int]) -> None:
    """G1 `blocks` (and their hidden states) into the payload of the encoded uint8 buffer `buf`
    (its header is the caller's). On a GPU, call it on the copy stream that waits for the
    forward which wrote the blocks."""
    idx = torch.tensor(blocks, dtype=torch.long, device=kv_cache.device)
    if layout.converts:  # --kv-offload-dtype: narrowed on the way down
        payload(buf, layout).copy_(layout.encode(kv_cache.index_select(2, idx)))
    elif kv_cache.device.type == "cpu":  # straight into the buffer, no temporary
        torch.index_select(kv_cache, 2, idx, out=payload(buf, layout))
    else:  # gathered on the device, one copy down
        payload(buf, layout).copy_(kv_cache.index_select(2, idx))
    if hidden_cache is None:
        return
    if hidden_cache.device.type == "cpu":
        torch.index_select(hidden_cache, 0, idx, out=hidden_payload(buf, layout))
    else:
        hidden_payload(buf, layout).copy_(hidden_cache.index_select(0, idx))

