"""The inference worker: one thread owns the model; a bounded queue sheds load instead of growing."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from service.errors import Overloaded
from service.metrics import QUEUE_DEPTH

log = logging.getLogger(__name__)

_END = object()


class Job:
    """A unit of model work: `fn(cancelled)` returns a value or yields events (a generator)."""

    def __init__(self, fn: Callable[[Callable[[], bool]], Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel_event = threading.Event()

    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def _emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is waiting; keep the worker alive
            self.cancel_event.set()

    def run(self) -> None:
        try:
            if self.cancelled():
                raise asyncio.CancelledError()
            out = self.fn(self.cancelled)
            if isinstance(out, Iterator):
                for ev in out:
                    self._emit(ev)
            else:
                self._emit(out)
        except BaseException as e:  # handed to the awaiting request, never kills the worker
            self._emit(e)
        finally:
            self._emit(_END)

    async def stream(self) -> AsyncIterator[Any]:
        """Events as they come; an exception raised in the worker is re-raised here."""
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


class InferenceWorker:
    def __init__(self, queue_size: int) -> None:
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._loop, name="inference-worker", daemon=True)
        self.busy = False
        self.thread.start()

    def submit(self, fn: Callable[[Callable[[], bool]], Any]) -> Job:
        job = Job(fn, asyncio.get_running_loop())
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                f"the inference queue is full ({self.queue.maxsize} waiting); retry shortly", retry_after_s=1
            ) from None
        QUEUE_DEPTH.set(self.queue.qsize())
        return job

    async def run(self, fn: Callable[[Callable[[], bool]], Any]) -> Any:
        return await self.submit(fn).result()

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            QUEUE_DEPTH.set(self.queue.qsize())
            if job is None:
                return
            self.busy = True
            try:
                job.run()
            finally:
                self.busy = False

    def stop(self, timeout_s: float = 5.0) -> None:
        try:
            self.queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self.thread.join(timeout_s)
