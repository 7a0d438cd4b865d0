"""An LRU that appends every session hint it is given to a file (`options.path`): how a test
sees, from outside the engine-core process, what a served request tells the tiers' policies."""
from __future__ import annotations

from policies import BlockInfo, LRUPolicy


class SessionLog(LRUPolicy):
    name = "session_log"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @classmethod
    def from_config(cls, capacity, options):  # type: ignore[no-untyped-def]
        if set(options) != {"path"}:
            raise ValueError(f"session_log takes exactly a 'path' option; got {sorted(options)}")
        return cls(str(options["path"]))

    def _log(self, info: BlockInfo) -> None:
        with open(self.path, "a") as f:
            f.write(f"{info.session}\n")

    def insert_block(self, key, info):  # type: ignore[no-untyped-def]
        self._log(info)
        super().insert_block(key, info)

    def touch_block(self, key, info):  # type: ignore[no-untyped-def]
        self._log(info)
        super().touch_block(key, info)
