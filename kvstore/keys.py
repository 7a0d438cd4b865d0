"""Block keys: chained content hashes that are stable across processes, machines and restarts.

key(block i) = sha256(key(block i-1) || token ids as little-endian int64 || extra), truncated to
16 bytes. `extra` carries the request's cache salt on the first block (tenant isolation), so
two salts never share any block, and with it the digest of the LoRA adapter's files (`adapter`:
the same tokens under two adapters, or two versions of one, have other KV), and the digests of the images whose placeholder tokens a block
holds (`media`: the same placeholder ids stand for any image). Python's hash() is never used: it is salted per process.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NewType

import numpy as np

BlockKey = NewType("BlockKey", bytes)

KEY_BYTES = 16
ROOT_KEY = BlockKey(b"\x00" * KEY_BYTES)


def block_key(parent: BlockKey, token_ids: Sequence[int], extra: bytes = b"") -> BlockKey:
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    if extra:
        # Length-prefixed so that (tokens, extra) pairs cannot alias each other.
        h.update(len(extra).to_bytes(4, "little") + extra)
    return BlockKey(h.digest()[:KEY_BYTES])


def chain_keys(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, start: int = 0,
    parent: BlockKey = ROOT_KEY, media: Callable[[int], bytes] | None = None, adapter: bytes = b"",
) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids`, from block index `start` (whose parent is `parent`).
    `media(i)`: the content digests of block i's images (b"" for none). `adapter`: the LoRA
    adapter's digest (b"" for the base model)."""
    keys: list[BlockKey] = []
    salt = cache_salt.encode() if cache_salt else b""
    if adapter:  # tagged with a byte no UTF-8 text (a salt) holds, then length-prefixed
        salt = b"\xfflora" + len(salt).to_bytes(4, "little") + salt + adapter
    for i in range(start, len(token_ids) // block_size):
        extra = salt if i == 0 else b""
        if media is not None and (digests := media(i)):
            # Tagged and length-prefixed: a salt can never read as a salt plus an image.
            extra = b"media" + len(extra).to_bytes(4, "little") + extra + digests
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        keys.append(parent)
    return keys


def token_digest(token_ids: Sequence[int]) -> bytes:
    """A digest of a block's tokens, stored beside cached KV so a key collision cannot alias."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).digest()[:KEY_BYTES]


def extend_keys(keys: list[BlockKey], token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                media: Callable[[int], bytes] | None = None, adapter: bytes = b"") -> None:
    """Appends to `keys` (a request's key list, grown lazily) the keys of its new full blocks."""
    if len(keys) < len(token_ids) // block_size:
        keys.extend(chain_keys(token_ids, block_size, cache_salt, len(keys), keys[-1] if keys else ROOT_KEY, media,
                               adapter))


def group_key(key: BlockKey, group: int) -> BlockKey:
    """The key of KV group `group`'s block for the token block `key` names (group 0 uses `key`
    itself): groups hold different layers, so their blocks of the same tokens differ."""
    return BlockKey(hashlib.sha256(b"kv-group" + group.to_bytes(4, "little") + key).digest()[:KEY_BYTES])
