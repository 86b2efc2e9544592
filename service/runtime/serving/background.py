"""The background step in progress: it gives way to live work between two decoder layers (runtime/preempt.py).

The engine calls `advance(work, ...)` in every step that gives background work time. A background step (one
forward of a calibration, a shadow check or a refinement) runs until it ends or until live work arrives; under load
also at most `slice_s` at a time, so a running stream's next token waits about a layer and a slice for it, not a
whole forward. A step that gave way is resumed where it stopped, before any other background work starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from service import metrics
from service.runtime.preempt import Resumable
from service.runtime.serving.work import Work

SLICE_S = 0.05  # under load a background step runs at most this long at a time (about one batched decode step)


class BackgroundStep:
    def __init__(self) -> None:
        self.work: Work | None = None  # whose step has started and not ended (it gave way)
        self._step: Resumable | None = None
        self.parks = 0  # times background steps gave way (tests, metrics)

    def advance(self, work: Work, arrived: Callable[[], bool], slice_s: float | None) -> None:
        """Run `work`'s current step (resumed, if it gave way before) until it ends, `arrived()` (live work came),
        or `slice_s` passed (None: no limit); an exception in it fails `work` only."""
        if work is not self.work:
            assert self.work is None, "a background step gave way and another was picked"
            self.work, self._step = work, Resumable(work.step)
        deadline = None if slice_s is None else time.perf_counter() + slice_s
        should_yield = arrived if deadline is None else (lambda: arrived() or time.perf_counter() >= deadline)
        try:
            done, _ = self._step.run(should_yield)
        except Exception as e:  # noqa: BLE001 - routed to the request that asked for the work
            done = True
            work.fail(e)
        if done:
            self.work = self._step = None
        else:
            self.parks += 1
            metrics.BACKGROUND_YIELDS.inc()

    def abandon(self) -> None:
        """The work whose step gave way is dropped (cancelled, or the engine stops): unwind its step."""
        if self._step is not None:
            self._step.kill()
        self.work = self._step = None
