"""Sample namespaces, model records, keys and values shared by the `kvtier kv` tests of G3
(tests/kvstore) and G4 (tests/remote): pure functions of an index, so a test can recompute what it wrote."""
from __future__ import annotations

import random

NS_A = bytes.fromhex("aa" * 16)
NS_B = bytes.fromhex("bb" * 16)
INFO_A = {"model": "/models/alpha", "dtype": "torch.float32"}
INFO_B = {"model": "/models/beta", "dtype": "torch.bfloat16"}


def key(i: int) -> bytes:
    return random.Random(i).randbytes(16)


def value(i: int, base: int = 3000) -> bytes:
    return random.Random(-i).randbytes(base + i)
