"""Start-up phases: each logs a line when it starts and one when it ends (with its duration), and `current` is what
/readyz names while the service is not ready, so a newcomer can tell a model conversion or a kernel check from a
hang. No torch here: the runtime reports its phases through the callable it is handed."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("service.startup")


class Phases:
    def __init__(self) -> None:
        self.current = "starting"
        self.took: dict[str, float] = {}  # phase -> seconds, in the order they ran

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        t0 = time.perf_counter()
        log.info("start-up: %s ...", name)
        ok = False
        try:
            yield
            ok = True
        finally:
            s = time.perf_counter() - t0
            self.took[name] = round(s, 2)
            log.info("start-up: %s %s in %.1f s", name, "done" if ok else "failed", s)

    def finish(self, ready: bool) -> None:
        self.current = "ready" if ready else "failed"
        log.info("start-up: %s after %.1f s (%s)", self.current, sum(self.took.values()),
                 ", ".join(f"{k} {v:.1f} s" for k, v in self.took.items()))
