"""G3's write back-off: after a write fails, writes are refused for a while, then tried again.

Its one piece of state is when writes may resume, and whether the operator was warned of the
current run of failures. The caller holds its own lock around the calls.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("kvstore.disk")  # the tier's own logger: its warnings read as the tier's


class WriteGate:
    def __init__(self, where: str, retry_after_s: float) -> None:
        self.where, self.retry_after_s = where, retry_after_s
        self._disabled_until: float | None = None  # writes refused until this monotonic time
        self._warned = False  # one warning per run of write failures

    @property
    def open(self) -> bool:
        """Whether writes are on (no failure waiting out its back-off)."""
        return self._disabled_until is None

    def allowed(self) -> bool:
        """Whether a write may be tried now: writes are on, or the back-off is over (then they are
        on again until the next failure)."""
        if self._disabled_until is not None and time.monotonic() < self._disabled_until:
            return False
        self._disabled_until = None
        return True

    def failed(self, err: OSError, what: str) -> None:
        """A write failed: refuse writes for `retry_after_s`, warning once per run of failures."""
        self._disabled_until = time.monotonic() + self.retry_after_s
        if not self._warned:
            self._warned = True
            logger.warning("G3 %s: %s failed (%s); writes disabled, retrying after %.0f s; reads continue",
                           self.where, what, err, self.retry_after_s)
        else:
            logger.debug("G3 %s: %s failed again (%s)", self.where, what, err)

    def worked(self) -> None:
        """A write succeeded: say so if the last ones had failed."""
        if self._warned:
            logger.info("G3 %s: writes work again", self.where)
            self._warned = False
