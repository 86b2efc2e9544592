"""ServingLoop: the model thread. It runs steps (scheduler.py says what each holds) until no work is left.

Request threads submit work and get a Job (work.py); everything that touches the model, the decode batch or a
request's cache runs here, on one thread (torch is imported here only once a model is bound, so the API can import
this module without it). A step: free the rows of requests that hung up, admit queued work, live prefill steps
within the token budget, one batched decode forward over the running sequences (runner.py), then background work
when its share is due. A background step gives way to live work between two decoder layers (background.py,
runtime/preempt.py): a request that arrives while one runs (~250 ms at 2.4k tokens of context on a CPU) waits about a
layer, not the whole step, and under load a step runs at most a 50 ms slice at a time. On an idle engine background
work still waits `background_idle_s` after the last live step, and under load a step within `background_idle_s` of a
request's end is not quiet (scheduler.next_background): the moments right after a response are when its client's
next request comes (docs/BENCHMARKS.md, "Background work under load"). Live work that arrives during a step's
forwards is admitted before that step's background turn, which then does not run: a slice gives way only to arrivals
after it starts, so it would hold that request for its whole length.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from service import metrics
from service.errors import LimitExceeded
from service.runtime.serving.background import SLICE_S, BackgroundStep
from service.runtime.serving.scheduler import Scheduler
from service.runtime.serving.starts import SequenceStarts
from service.runtime.serving.work import Call, Job, SequenceWork, StepsWork, Work

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_running: int = 16
    step_token_budget: int = 1024
    queue_size: int = 32
    kv_budget_bytes: int = 4 * 1024**3
    background_share: float = 0.1
    background_idle_s: float = 0.1
    torch_threads: int = 0  # the engine thread's; every other thread gets one (service/runtime/threads.py)
    shared_kv_reads: bool = True  # rows holding the same K/V chunks read them from one row (service/kv/batch.py)

    @classmethod
    def from_settings(cls, s) -> "EngineConfig":
        return cls(s.max_running_seqs, s.step_token_budget, s.queue_size, s.kv_budget_bytes, s.background_share,
                   s.background_idle_ms / 1e3, s.torch_threads, s.shared_kv_reads)


class ServingLoop(SequenceStarts):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.sched = Scheduler(config.max_running, config.step_token_budget, config.queue_size,
                               config.background_share)
        self.batch = None  # DecodeBatch, once bound
        self.rt = None
        self.bytes_per_token = 0  # K+V of one token over all layers, once bound
        self._wake = threading.Condition()
        self._stopping = False
        self._in_step = False
        self._t_live = 0.0  # when the last step with live work ended (monotonic)
        self._t_end = 0.0  # when live work last finished (monotonic): its client's next request may follow at once
        self.bg = BackgroundStep()  # a background step gives way to live work that arrives while it runs
        self._arrivals = 0  # live work submitted so far
        self.thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
        self.thread.start()

    # ---- request threads ------------------------------------------------------------------
    def bind(self, rt) -> None:
        """Serve `rt`'s model (call on the engine: `await engine.run(lambda c: engine.bind(rt))`)."""
        from service.runtime import preempt
        from service.runtime.decode import TokenStream
        from service.runtime.serving.runner import DecodeBatch

        self.rt, self.batch = rt, DecodeBatch(rt, share_chunks=self.config.shared_kv_reads)
        self._stream_cls = TokenStream
        self.bytes_per_token = rt.kv_bytes_per_token()
        preempt.install(rt.model)

    def _submit(self, work: Work) -> Job:
        accepted = self.sched.add(work)
        if accepted:
            self._arrivals += 0 if work.background else 1
            with self._wake:
                self._wake.notify()
        else:
            work.job.cancel_event.set()
            work.close()
        return work.job

    def submit(self, fn: Callable[[Callable[[], bool]], Any]) -> Job:
        """A one-off closure fn(cancelled), run between steps."""
        return self._submit(Call(Job(asyncio.get_running_loop()), fn))

    async def run(self, fn: Callable[[Callable[[], bool]], Any]) -> Any:
        return await self.submit(fn).result()

    def submit_steps(self, steps: Generator[int, None, Any], background: bool = False,
                     priority: float | Callable[[], float] = 0.0, idle_only: Callable[[], bool] | None = None) -> Job:
        """Step-generator work; background work runs in the background share, lowest `priority` first (a callable
        is read each time background work is picked); while `idle_only()` is true, only when no live work is pending
        (speculative work: it takes no share from live requests)."""
        return self._submit(StepsWork(Job(asyncio.get_running_loop()), steps, background, priority, idle_only))

    async def run_steps(self, steps: Generator[int, None, Any], background: bool = False,
                        priority: float | Callable[[], float] = 0.0, idle_only: Callable[[], bool] | None = None
                        ) -> Any:
        """Its value; None for background work dropped because the backlog is full."""
        return await self.submit_steps(steps, background, priority, idle_only).result()

    def submit_sequence(self, steps: Generator[int, None, Any], params, n_prompt: int, keep_cache: bool = False,
                        on_prefilled: Callable[[Any], None] | None = None,
                        on_joined: Callable[[Any], None] | None = None) -> Job:
        """A generating request: `steps` prefill it (returning a PrefillResult), then it decodes in the batch. The
        job streams Delta events and one Done; keep_cache: `job.cache` holds its K/V when Done arrives. on_joined(pre),
        on the model thread: the prefill's cache is complete up to where the batch took it over
        (SequenceWork.joined)."""
        work = SequenceWork(Job(asyncio.get_running_loop()), steps, params, n_prompt, keep_cache, on_prefilled,
                            on_joined)
        if self.bytes_per_token and 2 * work.need_tokens * self.bytes_per_token > self.config.kv_budget_bytes:
            steps.close()
            raise LimitExceeded(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{2 * work.need_tokens * self.bytes_per_token / 2**20:.0f} MiB of K/V while it joins the batch, more "
                f"than the KV budget ({self.config.kv_budget_bytes / 2**20:.0f} MiB, SKILLCACHE_KV_BUDGET_BYTES); "
                "use fewer or shorter skills or lower max_tokens")
        return self._submit(work)

    def pause_background(self) -> None:
        """Hold background work (queued, not run) until resume_background: tests, and an operator's A/B."""
        self.sched.background_paused = True

    def resume_background(self) -> None:
        self.sched.background_paused = False
        with self._wake:
            self._wake.notify()

    @property
    def busy(self) -> bool:
        return self._in_step or self.sched.has_work()

    @property
    def serving(self) -> bool:
        """Live work queued or running, background work aside: other requests, as seen by one whose own work has
        finished (its result may arrive before the step that finished it ends)."""
        return self.sched.has_unfinished_live()

    @property
    def n_waiting(self) -> int:
        return len(self.sched.waiting)

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self.thread.join(timeout_s)

    # ---- the model thread -----------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        from service.runtime.threads import claim

        claim(self.config.torch_threads)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._stopping and (wait := self._wait_s()) != 0.0:
                        self._wake.wait(wait)
                    if self._stopping:
                        break
                self._in_step = True
                try:
                    self._step()
                except Exception:  # never kill the engine: each failure was routed to its request
                    log.exception("engine step failed")
                finally:
                    self._in_step = False
        self.bg.abandon()
        for w in self.sched.drain_all():
            w.close()

    def _wait_s(self) -> float | None:
        """How long to wait before the next step: 0.0 now (live work, or background work once the engine has been
        idle long enough), None until woken (no work), else until background work may start. The clock is read
        once: read twice, an idle wait ending between the reads would wait for a wake-up that never comes."""
        if self.sched.has_live():
            return 0.0
        if not self.sched.has_work():
            return None
        return self._idle_left()

    def _idle_left(self) -> float:
        """Seconds until background work may start on an idle engine (0: now)."""
        return max(0.0, self._t_live + self.config.background_idle_s - time.monotonic())

    def _step(self) -> None:
        t0 = time.perf_counter()
        for w in self.sched.reap():
            self._drop(w)
        self.sched.admit(self._fits)
        live_pending = bool(self.sched.waiting or self.sched.active or self.sched.running)  # waiting: not yet fit
        n_live = len(self.sched.active) + len(self.sched.running)
        # prefill before decode: a new request's first token (sampled when its prefill ends) does not wait for the
        # running rows' forward, and a sequence that joins decodes its second token in this same step
        self._prefill(self.sched.prefill_budget())
        if self.sched.running:
            self._decode()
        t_live = time.perf_counter() - t0
        if len(self.sched.active) + len(self.sched.running) < n_live:
            self._t_end = time.monotonic()
        quiet = not (self.sched.waiting or self.sched.active) and \
            time.monotonic() - self._t_end >= self.config.background_idle_s
        bg_s = 0.0
        # live work that arrived during this step's forwards and can start now: its prefill is next, not a background
        # slice (a slice runs until the next arrival, and this one came before it)
        arrived = self.sched.admit(self._fits)
        work = None if arrived else self.sched.next_background(live_pending, quiet, self.bg.work)
        if work is not None:
            t1, n = time.perf_counter(), self._arrivals
            self.bg.advance(work, lambda: self._arrivals != n, SLICE_S if live_pending else None)
            bg_s = time.perf_counter() - t1
        self.sched.account(t_live, bg_s)
        self.sched.gauges()
        metrics.KV_BYTES.set(self.kv_bytes())
        metrics.SHARED_ROWS.set(self.batch.shared_rows if self.batch is not None else 0)
        if live_pending:
            metrics.STEP_TIME.observe(time.perf_counter() - t0)
            self._t_live = time.monotonic()

    def _advance(self, work: Work) -> int:
        """One step of `work`; a failure goes to its request only."""
        try:
            return work.step()
        except Exception as e:  # noqa: BLE001 - routed to the request that asked for the work
            work.fail(e)
            return 0

    def _decode(self) -> None:
        rows = self.sched.running
        try:
            logits = self.batch.step([w.next_token for w in rows])  # [B, V]
        except Exception as e:  # noqa: BLE001 - fails the batch, not the engine
            log.exception("batched decode failed")
            for w in reversed(rows):
                self.batch.leave(w.row)
                w.fail(e)
            rows.clear()
            return
        metrics.BATCH_SIZE.observe(len(rows))
        metrics.DECODE_TOKENS.inc(len(rows))
        greedy = logits.argmax(-1).tolist()
        done = []
        for i, w in enumerate(rows):
            tok = greedy[i] if w.out.greedy else w.out.sample(logits[i].cpu())
            w.emit_all(w.out.push(tok))
            if w.out.reason is not None:
                done.append(w)
            else:
                w.next_token = tok
        for w in sorted(done, key=lambda w: -w.row):
            self._leave(w)
            w.finish()

    def _leave(self, w: SequenceWork) -> None:
        """Free w's row; the last row moves into it."""
        rows, row = self.sched.running, w.row
        cache = self.batch.leave(row, keep_cache=w.keep_cache)
        if w.keep_cache:
            w.job.cache = cache
        last = rows.pop()
        if last is not w:
            rows[row] = last
            last.row = row
        w.row = None

    def _drop(self, w: Work) -> None:
        """A cancelled request's work: free what it holds, end its stream."""
        if w.is_sequence and w.row is not None:
            self._leave(w)
            w.finish("cancelled")
        elif w.is_sequence and w.out is not None:
            w.finish("cancelled")
        else:
            if w is self.bg.work:
                self.bg.abandon()
            w.close()

    def _fits(self, w: SequenceWork) -> bool:
        """The scheduler's KV admission rule (Scheduler.kv_fits) on this engine's batch and budget."""
        return self.sched.kv_fits(w, self.batch.kv if self.batch is not None else None, self.bytes_per_token,
                                  self.config.kv_budget_bytes)

    def kv_bytes(self) -> int:
        """K/V the engine holds now: the decode batch's buffers (prefill caches are counted by their requests)."""
        return self.batch.size_bytes if self.batch is not None else 0
