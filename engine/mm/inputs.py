"""What a multimodal request carries: its items (one per run of placeholder tokens), each with a
digest of its content that enters the keys of the blocks that hold it.

Scheduler side, no computation: an item's pixels ride along for the runner's encoder, which is
the only reader. Two prompts with the same text and different images have the same placeholder
token ids, so a key over token ids alone would hand one image's KV to the other: every block that
overlaps an item's placeholders gets the item's digest into its key, and every later block
follows from it through the chain.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.mm.spec import ImageSpec

DIGEST_BYTES = 16


@dataclass(frozen=True, eq=False)
class MMItem:
    """One image (or one crop of it) in a prompt: its placeholder tokens are positions
    [offset, offset + length), which attend to each other both ways in the prefill (Gemma 3's
    vision blocks) and whose embeddings are the encoder's output for `pixels`."""
    offset: int
    length: int
    digest: bytes  # of the processed pixels: another image, or another preprocessing, is another digest
    pixels: Any  # the processor's pixel_values for this item (a torch tensor; engine/mm/spec.py has the shapes)
    grid: tuple[int, int] | None = None  # (rows, cols) of real patches, for a variable-resolution encoder (Gemma 4)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"multimodal item at {self.offset} with {self.length} tokens")
        if self.grid is not None and (len(self.grid) != 2 or not all(isinstance(g, int) for g in self.grid)):
            raise ValueError(f"multimodal item grid must be two ints; got {self.grid!r}")
        if len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"multimodal item digest must be {DIGEST_BYTES} bytes; got {len(self.digest)}")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class MMInputs:
    """A prompt's items, in order, not overlapping."""
    items: tuple[MMItem, ...]

    def __post_init__(self) -> None:
        for a, b in zip(self.items, self.items[1:]):
            if b.offset < a.end:
                raise ValueError(f"multimodal items overlap or are out of order at position {b.offset}")

    def overlapping(self, start: int, end: int) -> tuple[MMItem, ...]:
        """Items with a placeholder in positions [start, end)."""
        return tuple(it for it in self.items if it.offset < end and start < it.end)

    def block_extra(self, index: int, block_size: int) -> bytes:
        """The digests of the items a block holds placeholders of (b"" for a text-only block)."""
        return b"".join(it.digest for it in self.overlapping(index * block_size, (index + 1) * block_size))

    def cut(self, start: int, n: int, budget: int, images: int) -> int:
        """How many of `n` tokens from `start` a step may compute without ending inside an item
        (whose tokens must all be in one forward: they attend to each other both ways) and with
        at most `images` items in it: `n`, or fewer to stop before an item, or more (up to
        `budget`) to finish an item started at or before `start`; 0 when that does not fit."""
        end, seen = start + n, 0
        for it in self.items:
            if it.end <= start:
                continue
            if it.offset >= end:
                break
            if seen == images:  # no room for another image in this step
                return max(0, it.offset - start)
            seen += 1
            if it.offset < end < it.end:
                if it.offset > start:
                    return it.offset - start
                return it.end - start if it.end - start <= budget else 0
        return n

    def check_items(self, token_ids: Sequence[int], spec: ImageSpec) -> None:
        """ValueError unless every item sits on image placeholder tokens of the prompt and has
        pixels the encoder takes, as many placeholders as they make (`spec.check`): a request
        built elsewhere (the server's channel) must not reach the encoder or overwrite text."""
        for it in self.items:
            if it.end > len(token_ids) or any(t != spec.image_token_id for t in token_ids[it.offset:it.end]):
                raise ValueError(f"an image item at {it.offset} ({it.length} tokens) does not sit on image "
                                 "placeholder tokens of the prompt")
            spec.check(it)

    def check_fits(self, budget: int) -> None:
        """ValueError unless every item fits in one step of `budget` tokens."""
        for it in self.items:
            if it.length > budget:
                raise ValueError(f"an image takes {it.length} tokens, more than the {budget} one step computes "
                                 "(max_num_batched_tokens)")


def items_from_spans(spans: Sequence[tuple[int, int]], digests: Sequence[bytes], pixels: Sequence[Any],
                     grids: Sequence[tuple[int, int] | None] | None = None) -> MMInputs:
    """MMInputs from (offset, length) spans with their digests, pixels and grids, one each."""
    grids = grids if grids is not None else [None] * len(pixels)
    if not len(spans) == len(digests) == len(pixels) == len(grids):
        raise ValueError(f"{len(spans)} image placeholder runs but {len(pixels)} images")
    return MMInputs(tuple(MMItem(o, n, d, p, g) for (o, n), d, p, g in zip(spans, digests, pixels, grids)))
