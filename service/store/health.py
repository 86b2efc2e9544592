"""One backend's up/down state, shared by the block tiers (tiered.py) and the definitions cache
(definitions_cache.py): a backend that raised StoreUnavailable is skipped for `retry_interval_s`, then one caller
probes it (the others keep skipping), so a black-holed Redis costs one timeout per interval, not one per request."""

from __future__ import annotations

import logging
import time

from service.metrics import STORE_UP
from service.store.errors import StoreUnavailable

log = logging.getLogger(__name__)


class BackendHealth:
    def __init__(self, what: str, retry_interval_s: float, gauge: bool = False) -> None:
        self.what = what  # for the log: "store tier redis", "definition store redis"
        self.retry_interval_s = retry_interval_s
        self.gauge = gauge  # set skillcache_store_up{tier} (block tiers)
        self.name = what.rsplit(" ", 1)[-1]
        self.down: str | None = None  # the last StoreUnavailable message while down
        self.retry_at = 0.0  # monotonic time before which a down backend is skipped
        self.write_error: str | None = None  # the last StoreWriteError, cleared by the next successful write
        self.was_up = False  # reached at least once

    def available(self) -> bool:
        """Up, or down but due for a retry: this caller gets the probe."""
        if self.down is None:
            return True
        now = time.monotonic()
        if now < self.retry_at:
            return False
        self.retry_at = now + self.retry_interval_s
        return True

    def mark_down(self, err: StoreUnavailable, serving: str = "serving without it") -> None:
        if self.down is None:
            log.warning("%s is down, %s: %s", self.what, serving, err)
        self.down, self.retry_at = str(err), time.monotonic() + self.retry_interval_s
        if self.gauge:
            STORE_UP.labels(tier=self.name).set(0)

    def mark_up(self) -> None:
        self.was_up = True
        if self.gauge:
            STORE_UP.labels(tier=self.name).set(1)
        if self.down is not None:
            log.warning("%s is back", self.what)
            self.down = None

    def status(self) -> str:
        """The last known state: "ok", "down: <error>" or "degraded: <write error>"."""
        return f"down: {self.down}" if self.down else f"degraded: {self.write_error}" if self.write_error else "ok"
