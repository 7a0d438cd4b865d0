"""Token-id validation shared by the engine (offline API) and the server (before queueing)."""
from __future__ import annotations

import operator
from collections.abc import Iterable


def _in_range(t: object, vocab_size: int) -> bool:
    if isinstance(t, bool):
        return False
    try:
        return 0 <= operator.index(t) < vocab_size
    except TypeError:
        return False


def check_token_ids(ids: Iterable[object], vocab_size: int, what: str) -> None:
    """ValueError naming the first id outside [0, vocab_size) (or not an integer): the embedding
    and the sampler index with these, and an id out of range raised inside the engine's step."""
    for t in ids:
        if not _in_range(t, vocab_size):
            raise ValueError(f"{what} {t!r} is outside the vocabulary [0, {vocab_size})")
