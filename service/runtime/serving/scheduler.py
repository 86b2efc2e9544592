"""Scheduler: which work runs in the next engine step. Queues and policy only; no tensors, no model.

Like vLLM's V1 scheduler, a step is not a prefill step or a decode step: it is one batched decode forward over
every running sequence (a token each) plus live prefill work from the head of the queue, within one token budget
(`step_token_budget`, minus the decode tokens), plus background work (seam calibration, shadow checks,
refinement of repeated skill orders) when its share of the engine's busy time is due, preferably in a step where
no first token is awaited (next_background). Work is admitted in arrival
order (first come, first served, no skipping) while the running sequences stay within `max_running` and the
batch's K/V within the KV budget; the rest waits in a bounded queue, and past that a request gets
`429 overloaded`. A sequence reserves its whole length (prompt + max_tokens) when admitted, so nothing is
preempted and memory never runs past the budget. nano-vllm splits the same concerns into scheduler, block manager
and model runner; here the policy is this file (queues, admission by KV budget, the prefill split, the background
share), the mechanism is engine.py and starts.py (running the steps) and runner.py (the decode batch's K/V).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from service import metrics
from service.errors import Overloaded
from service.runtime.serving.work import SequenceWork, Work

SHARE_WINDOW_S = 10.0  # the background share is measured over a decaying window of about this long


class Scheduler:
    def __init__(self, max_running: int, step_token_budget: int, queue_size: int, background_share: float,
                 background_backlog: int = 64) -> None:
        self.max_running, self.step_token_budget = max_running, step_token_budget
        self.queue_size, self.background_share, self.background_backlog = queue_size, background_share, \
            background_backlog
        self.lock = threading.Lock()  # `waiting` and `background` take work from other threads
        self.waiting: deque[Work] = deque()  # live work not admitted yet, arrival order
        self.active: list[Work] = []  # admitted live work with steps left: prefilling sequences, compiles, calls
        self.running: list[SequenceWork] = []  # decoding: running[i] is row i of the decode batch
        self.background: list[Work] = []  # backlog, at most background_backlog: lowest priority first, then arrival
        self.background_paused = False  # ServingLoop.pause_background: background work waits, queued
        self.live_s = self.background_s = 0.0  # busy time in the decaying window
        self._t_account = time.monotonic()

    # ---- from request threads ---------------------------------------------------------------
    def add(self, work: Work) -> bool:
        """Queue work. Live work past the queue bound raises Overloaded; background work past its backlog is
        dropped (False) and retried by whoever asked for it later."""
        with self.lock:
            if work.background:
                if len(self.background) >= self.background_backlog:
                    return False
                self.background.append(work)
                return True
            if len(self.waiting) >= self.queue_size:
                raise Overloaded(f"the inference queue is full ({self.queue_size} waiting); retry shortly",
                                 retry_after_s=1)
            self.waiting.append(work)
            metrics.QUEUE_DEPTH.set(len(self.waiting))
            return True

    # ---- on the model thread ----------------------------------------------------------------
    @property
    def n_sequences(self) -> int:
        return len(self.running) + sum(w.is_sequence for w in self.active)

    def has_live(self) -> bool:
        return bool(self.waiting or self.active or self.running)

    def has_unfinished_live(self) -> bool:
        """Live work not finished yet; safe from other threads (a snapshot of each list). Work that finished in the
        step now running stays listed until that step removes it, after its job already has the result."""
        return any(not w.finished for q in (self.waiting, self.active, self.running) for w in tuple(q))

    def has_work(self) -> bool:
        return bool(self.waiting or self.active or self.running or (self.background and not self.background_paused))

    def admit(self, fits: Callable[[SequenceWork], bool]) -> int:
        """Move work from the head of the queue to `active` while the sequence count and `fits` (the KV budget)
        allow; how many moved. Strict arrival order: a sequence that does not fit yet holds back those behind it."""
        n = 0
        with self.lock:
            while self.waiting:
                w = self.waiting[0]
                if w.is_sequence and (self.n_sequences >= self.max_running or not fits(w)):
                    break
                self.waiting.popleft()
                self.active.append(w)
                n += 1
                metrics.QUEUE_WAIT.observe(time.monotonic() - w.t_submit)
            metrics.QUEUE_DEPTH.set(len(self.waiting))
        return n

    def kv_fits(self, w: SequenceWork, kv, bytes_per_token: int, budget_bytes: int) -> bool:
        """Admission by KV budget: would the K/V of every admitted sequence, w included, stay within the budget once
        all have joined (the batch `kv` padded to its longest reservation, and never smaller than the buffers it keeps
        from earlier rows) while their prefill caches exist? One sequence always fits: an idle batch gives back kept
        buffers first if they and w's prefill would not. `kv`: the decode batch's buffers (runner.py)."""
        if not bytes_per_token or kv is None:
            return True
        seqs = self.running + [x for x in self.active if x.is_sequence]
        slots = max(kv.slots_for(len(seqs) + 1), kv.slots)
        cap = max(kv.padded(max(x.need_tokens for x in (*seqs, w))), kv.capacity)
        prefilling = sum(x.n_prompt for x in seqs if x.row is None) + w.n_prompt
        if (slots * cap + prefilling) * bytes_per_token <= budget_bytes:
            return True
        if not seqs and kv.n_rows == 0:
            kv.release()
        return not seqs

    def prefill_budget(self) -> int:
        """Tokens live prefill work may run this step (at least one step of it always runs)."""
        return max(1, self.step_token_budget - len(self.running))

    @staticmethod
    def prefill_share(budget: int) -> int:
        """Tokens one request's prefill may take per pass over the admitted work: half the step's budget, so the
        oldest request finishes first while a short one behind a long prefill still finishes in the same step (the
        long one goes on in chunks)."""
        return max(1, budget // 2)

    def next_background(self, live_pending: bool, quiet: bool = True, current: Work | None = None) -> Work | None:
        """The background work to step now, or None: always when nothing live is pending; under load only while
        its share of the window's busy time is below `background_share`, and in a step that is not `quiet` (a
        request waits or prefills, or one just finished and its client's next request is on the way: a first
        token is awaited) only while it is below half of that. So background steps go between decode steps, where
        they delay a running stream's next token, not a new request's first, yet keep half their share when quiet
        steps are rare. `current`: background work whose step gave way to live work mid-forward goes on first.
        Work that waits for idle (StepsWork.idle_only) is passed over while live work is pending."""
        with self.lock:
            self.background = [w for w in self.background if not w.finished]
            if not self.background or self.background_paused:
                return None
            if live_pending:
                share = self.background_share * (1.0 if quiet else 0.5)
                if share <= 0 or self.background_s > share * (self.live_s + self.background_s):
                    return None
            if current is not None and not current.finished:
                return None if live_pending and current.waits_for_idle() else current
            # priorities may change while work waits (a refinement whose order keeps repeating): pick afresh
            ready = [w for w in self.background if not (live_pending and w.waits_for_idle())]
            return min(ready, key=lambda w: (w.current_priority(), w.seq_no)) if ready else None

    def account(self, live_s: float, background_s: float) -> None:
        """Add a step's busy time to the decaying window."""
        now = time.monotonic()
        decay = math.exp(-(now - self._t_account) / SHARE_WINDOW_S)
        self._t_account = now
        self.live_s = self.live_s * decay + live_s
        self.background_s = self.background_s * decay + background_s
        metrics.ENGINE_BUSY.labels("live").inc(live_s)
        metrics.ENGINE_BUSY.labels("background").inc(background_s)
        total = self.live_s + self.background_s
        metrics.BACKGROUND_SHARE.set(self.background_s / total if total else 0.0)

    def reap(self) -> list[Work]:
        """Remove and return work whose request has gone (client hung up): freed within one step."""
        gone: list[Work] = []
        with self.lock:
            for queue in (self.waiting, self.active):
                for w in [w for w in queue if w.job.cancelled()]:
                    queue.remove(w)
                    gone.append(w)
            dropped = [w for w in self.background if w.job.cancelled()]
            if dropped:
                self.background = [w for w in self.background if w not in dropped]
                gone += dropped
        gone += [w for w in self.running if w.job.cancelled()]  # the engine frees their rows
        return gone

    def drain_all(self) -> list[Work]:
        """Everything still queued or running (the engine stops)."""
        with self.lock:
            out = [*self.waiting, *self.active, *self.running, *self.background]
            self.waiting.clear()
            self.active.clear()
            self.background.clear()
        return out

    def gauges(self) -> None:
        metrics.SEQUENCES.labels("waiting").set(sum(w.is_sequence for w in self.waiting))
        metrics.SEQUENCES.labels("prefilling").set(sum(w.is_sequence for w in self.active))
        metrics.SEQUENCES.labels("running").set(len(self.running))
