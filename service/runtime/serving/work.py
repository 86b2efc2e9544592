"""What the serving engine schedules, and the asyncio side of each piece of work.

A `Job` is what a request holds: the events its work emits (thread-safe, from the model thread), its cancel flag,
and its result. The work itself is one of
- `Call`: a one-off closure `fn(cancelled)` (the start-up self-check); it runs between steps, alone;
- `StepsWork`: a step generator (service.runtime.model.Steps: each `next` runs at most a chunk of tokens
  through the model and yields how many), live (a skill compile, a session's opening) or background (calibration,
  shadow checks, refinement);
- `SequenceWork`: a request that generates: its prefill as steps, then a row of the decode batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

_END = object()
log = logging.getLogger(__name__)
_ids = itertools.count()


class Job:
    """The request's handle: events as they come, a cancel flag the model thread checks every step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel_event = threading.Event()
        self.cache = None  # SequenceWork(keep_cache=True): the sequence's K/V after its last token

    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is waiting
            self.cancel_event.set()

    def end(self) -> None:
        self.emit(_END)

    async def stream(self) -> AsyncIterator[Any]:
        """Events as they come; an exception raised in the work is re-raised here."""
        try:
            while True:
                item = await self.events.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel_event.set()  # consumer gone (finished, error or client disconnect): stop work

    async def result(self) -> Any:
        out = None
        async for item in self.stream():
            out = item
        return out


class Work:
    """A unit the scheduler orders. `step()` runs one step on the model thread and returns the tokens it ran."""

    background = False
    is_sequence = False

    def __init__(self, job: Job, priority: float | Callable[[], float] = 0.0) -> None:
        self.job, self.priority = job, priority  # a callable: read each time the scheduler picks background work
        self.seq_no = next(_ids)
        self.t_submit = time.monotonic()
        self.finished = False

    def current_priority(self) -> float:
        return self.priority() if callable(self.priority) else self.priority

    def waits_for_idle(self) -> bool:
        """True: passed over while live work is pending (speculative background work)."""
        return False

    def step(self) -> int:
        raise NotImplementedError

    def fail(self, error: BaseException) -> None:
        self.finished = True
        self.job.emit(error)
        self.job.end()

    def close(self) -> None:
        """Dropped unfinished (cancelled, or the engine stops)."""
        self.finished = True
        self.job.end()


class Call(Work):
    def __init__(self, job: Job, fn: Callable[[Callable[[], bool]], Any]) -> None:
        super().__init__(job)
        self.fn = fn

    def step(self) -> int:
        self.finished = True
        self.job.emit(self.fn(self.job.cancelled))
        self.job.end()
        return 0


class StepsWork(Work):
    def __init__(self, job: Job, steps: Generator[int, None, Any], background: bool = False,
                 priority: float | Callable[[], float] = 0.0, idle_only: Callable[[], bool] | None = None) -> None:
        super().__init__(job, priority)
        self.steps, self.background = steps, background
        self.idle_only = idle_only  # background work that runs only while no live work is pending (read each pick)

    def waits_for_idle(self) -> bool:
        return self.idle_only is not None and self.idle_only()

    def step(self) -> int:
        try:
            return next(self.steps)
        except StopIteration as done:
            self.finished = True
            self.job.emit(done.value)
            self.job.end()
            return 0

    def close(self) -> None:
        self.steps.close()
        super().close()


class SequenceWork(StepsWork):
    """A generating request. Its prefill steps return a PrefillResult; then the engine samples its first token and,
    unless that ends it, the sequence joins the decode batch as a row (`row`) with its TokenStream (`out`)."""

    is_sequence = True

    def __init__(self, job: Job, steps: Generator[int, None, Any], params, n_prompt: int, keep_cache: bool = False,
                 on_prefilled: Callable[[Any], None] | None = None,
                 on_joined: Callable[[Any], None] | None = None) -> None:
        super().__init__(job, steps)
        self.params, self.n_prompt, self.keep_cache = params, n_prompt, keep_cache
        self.on_prefilled = on_prefilled
        self.on_joined = on_joined  # the prefill's cache is complete and nothing writes to it again
        self.prefill = None  # PrefillResult once its steps are done
        self.out = None  # TokenStream
        self.row: int | None = None
        self.next_token: int | None = None  # sampled, not yet run through the model

    @property
    def need_tokens(self) -> int:
        """Tokens its batch row must hold at most: the prompt and every generated token but the last."""
        return self.n_prompt + self.params.max_tokens

    def step(self) -> int:
        try:
            return next(self.steps)
        except StopIteration as done:
            self.prefill = done.value
            if self.prefill.tail is None:  # a deferred tail: once the engine has run it
                self.prefilled()
            return 0

    def prefilled(self) -> None:
        """The prefill is complete (its logits exist): tell the request, before its first token is sampled."""
        if self.on_prefilled is not None:
            self.on_prefilled(self.prefill)

    def joined(self) -> None:
        """The prefill cache is about to be let go (the batch copied it, or the request ends at its first token): its
        K/V stay as they are from now on, so the hook may keep views of them (automatic reuse). A failing hook is
        logged, never the request's error."""
        if self.on_joined is not None and self.prefill is not None and self.prefill.cache is not None:
            try:
                self.on_joined(self.prefill)
            except Exception:  # noqa: BLE001
                log.exception("on_joined hook failed")

    def emit_all(self, events: list) -> None:
        for ev in events:
            self.job.emit(ev)

    def finish(self, reason: str | None = None) -> None:
        self.finished = True
        self.emit_all(self.out.finish(reason) if self.out is not None else [])
        self.job.end()
