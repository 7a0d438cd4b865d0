"""The adapters the engine serves (core side, no tensors): each known adapter's checked
description and the runner slot its weights are in. `--max-loras` slots: a step can mix that many
adapters and the base model; an adapter added when every slot is taken replaces one that no
unfinished request uses, else it is refused naming the flag.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.lora.adapter import AdapterInfo, LoRARequest, read_info

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterRef:
    """What a request carries of its adapter: the slot its rows use, the digest its keys take."""
    name: str
    slot: int
    digest: bytes


class LoRARegistry:
    def __init__(self, max_loras: int, max_rank: int, targets: frozenset[str],
                 load: Callable[[int, AdapterInfo], None], max_bytes: int | None = None) -> None:
        """`load(slot, info)`: the runner writes an adapter's weights into a slot. `max_bytes`: the
        largest weights file an adapter within the limits can have on this model (`max_adapter_bytes`)."""
        self.max_loras, self.max_rank, self.targets, self.max_bytes = max_loras, max_rank, targets, max_bytes
        self._load = load
        self._by_name: dict[str, tuple[AdapterInfo, int]] = {}
        self.requests: dict[str, int] = {}  # requests admitted under each adapter name (metrics)

    def count_request(self, name: str) -> None:
        self.requests[name] = self.requests.get(name, 0) + 1

    def add(self, req: LoRARequest, in_use: Callable[[str], bool]) -> AdapterRef:
        """The adapter of `req`, read and loaded if it is new or its files changed; ValueError
        naming what is wrong (the files, the limits, no free slot). `in_use(name)`: whether an
        unfinished request uses that adapter (its slot cannot change under it)."""
        info = read_info(req.lora_name, req.lora_path, self.max_rank, self.targets, self.max_bytes)
        known = self._by_name.get(info.name)
        if known is not None and known[0].digest == info.digest:
            return AdapterRef(info.name, known[1], info.digest)
        if known is not None:
            if in_use(info.name):
                raise ValueError(f"LoRA adapter {info.name!r} changed on disk while requests use it; retry when they "
                                 "finish")
            slot = known[1]
        else:
            taken = {s for _, s in self._by_name.values()}
            free = [s for s in range(self.max_loras) if s not in taken]
            if not free:
                idle = [n for n in self._by_name if not in_use(n)]
                if not idle:
                    raise ValueError(f"--max-loras {self.max_loras} adapters are in use ({', '.join(sorted(self._by_name))}); "
                                     f"{info.name!r} must wait for one to finish, or raise --max-loras")
                slot = self._by_name.pop(idle[0])[1]
                log.info("LoRA adapter %r leaves slot %d for %r", idle[0], slot, info.name)
            else:
                slot = free[0]
        self._load(slot, info)
        self._by_name[info.name] = (info, slot)
        log.info("LoRA adapter %r (rank %d, %s) from %s in slot %d", info.name, info.rank, ", ".join(sorted(info.targets)),
                 info.path, slot)
        return AdapterRef(info.name, slot, info.digest)

    def get(self, name: str) -> AdapterRef | None:
        known = self._by_name.get(name)
        return AdapterRef(name, known[1], known[0].digest) if known is not None else None

    def remove(self, name: str, in_use: Callable[[str], bool]) -> None:
        """Forgets an adapter (its slot is free); ValueError if unknown or in use."""
        if name not in self._by_name:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        if in_use(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by unfinished requests")
        del self._by_name[name]

    def adapters(self) -> dict[str, AdapterInfo]:
        return {n: info for n, (info, _) in self._by_name.items()}

    def check_integrity(self) -> None:
        slots = [s for _, s in self._by_name.values()]
        if len(set(slots)) != len(slots) or any(not 0 <= s < self.max_loras for s in slots):
            raise AssertionError(f"LoRA slots {slots} (max_loras {self.max_loras})")
