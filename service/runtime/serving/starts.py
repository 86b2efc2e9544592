"""How generating requests start on the serving engine: prefill passes within the step's token budget, the first
token, and joining the decode batch (a mixin of ServingLoop, engine.py; it runs on the model thread).

A composition's text tail is left to the engine (prefill_steps' defer_tail): when several finish composing one after
another with no forward in between (a burst of one-skill compositions: block copies only), each joins the batch with
the K/V before its tail and the tails run as one forward over their rows (service/kv/batch_tail.py): the linears
read the weights once for all of them. A ready tail waits for at most one forward of another request's prefill:
compositions that run seams or text keep their first tokens in arrival order (a closed loop of 8 clients on three
skills: median first token 6.0 s when all tails waited for the whole pass, 2.5 s one by one). One alone runs its
tail on its own cache, as a request did before, so a single request (and the serial setting) is unchanged.
"""

from __future__ import annotations

import logging
import time

from service.runtime.serving.work import Call, SequenceWork

log = logging.getLogger(__name__)


class SequenceStarts:
    """ServingLoop's prefill and first-token steps (uses its sched, batch, rt, _advance and _leave)."""

    def _prefill(self, budget: int) -> None:
        """Live prefill within `budget` tokens, over admitted work in arrival order, each taking at most the
        scheduler's prefill_share per pass (its first token comes out as soon as its own prefill ends, not when every
        request's has). Compositions that left their text tail to the engine (prefill_steps' defer_tail) and finish
        in this step run their tails together after."""
        tails: list[SequenceWork] = []
        self._prefill_pass(budget, tails)
        self._run_tails(tails)

    def _run_tails(self, tails: list[SequenceWork]) -> None:
        """The tails ready now: together if several, else alone; the list is emptied."""
        if len(tails) > 1:
            self._tails_together(tails)
        elif tails:
            self._tail_alone(tails[0])
        tails.clear()

    def _tail_alone(self, w: SequenceWork) -> None:
        """A deferred tail with no other to run with: on its own cache, as without deferral."""
        t0 = time.perf_counter()
        try:
            logits = self.rt.forward(w.prefill.tail, w.prefill.tail_start, w.prefill.cache)
        except Exception as e:  # noqa: BLE001 - routed to its request
            w.fail(e)
            return
        w.prefill.tail_done(logits, (time.perf_counter() - t0) * 1e3)
        w.prefilled()
        self._start_decoding(w)

    def _prefill_pass(self, budget: int, tails: list[SequenceWork]) -> None:
        spent, share = 0, self.sched.prefill_share(budget)
        while spent < budget and self.sched.active:
            for w in list(self.sched.active):
                took = 0
                while not w.finished and not (w.is_sequence and w.prefill is not None):
                    ran = self._advance(w)
                    if ran and tails:  # a ready tail waits for at most one forward of another request
                        self._run_tails(tails)
                    n = max(1, ran)  # every step counts: no pass of zero-token steps loops
                    took, spent = took + n, spent + n
                    if isinstance(w, Call):
                        spent = budget  # a closure runs alone: it may take any time
                    if took >= share or spent >= budget:
                        break
                if w.finished:
                    self.sched.active.remove(w)
                elif w.is_sequence and w.prefill is not None:
                    self.sched.active.remove(w)
                    if w.prefill.tail is not None:
                        tails.append(w)
                    else:
                        self._start_decoding(w)
                if spent >= budget:
                    return

    def _start_decoding(self, w: SequenceWork) -> None:
        """Sample the first token from the prefill logits; unless that ends the request, join the batch."""
        pre = w.prefill
        try:
            tok = self._first_token(w)
            if w.out.reason is not None or w.job.cancelled():
                if w.keep_cache:
                    w.job.cache = pre.cache  # the session's now: it appends to it
                else:
                    w.joined()
                w.finish("cancelled")
                return
            self._join(w)
        except Exception as e:  # noqa: BLE001
            w.fail(e)
            return
        w.next_token = tok

    def _first_token(self, w: SequenceWork) -> int:
        w.out = self._stream_cls(self.rt.tokenizer, self.rt.eos_ids, w.params, w.prefill.logits)
        tok = w.out.sample(w.prefill.logits.cpu())
        w.emit_all(w.out.push(tok))
        return tok

    def _join(self, w: SequenceWork, joining: tuple[SequenceWork, ...] = ()) -> None:
        """w's prefill cache becomes the batch's last row (joining: the others joining right after it)."""
        coming = [x for x in self.sched.active if x.is_sequence] + list(joining)  # room for them too
        w.row = self.batch.join(w.prefill.cache, max([w.need_tokens] + [x.need_tokens for x in coming]),
                                len(self.sched.running) + 1 + len(coming))
        w.joined()  # copied: nothing writes to the prefill's buffers again
        w.prefill.cache = None  # the batch holds its K/V now
        self.sched.running.append(w)

    def _tails_together(self, ws: list[SequenceWork]) -> None:
        """Compositions whose text tails are left: each joins the batch with the K/V before its tail, the tails run
        as one forward over their rows (DecodeBatch.prefill_tails), then each samples its first token."""
        t0 = time.perf_counter()
        joined: list[SequenceWork] = []
        try:
            for i, w in enumerate(ws):
                self._join(w, tuple(ws[i + 1:]))
                joined.append(w)
            logits = self.batch.prefill_tails([w.prefill.tail for w in ws])  # [B', V]
        except Exception as e:  # noqa: BLE001 - fails these requests, not the engine
            log.exception("tails prefilled together failed")
            for w in reversed(joined):
                self._leave(w)
            for w in ws:
                w.fail(e)
            return
        ms = (time.perf_counter() - t0) * 1e3
        done = []
        for i, w in enumerate(ws):
            try:
                w.prefill.tail_done(logits[i], ms)
                w.prefilled()
                w.next_token = self._first_token(w)
            except Exception as e:  # noqa: BLE001
                w.out = None
                done.append((w, e))
                continue
            if w.out.reason is not None or w.job.cancelled():
                done.append((w, None))
        for w, err in sorted(done, key=lambda d: -d[0].row):
            self._leave(w)
            if err is not None:
                w.fail(err)
            else:
                w.finish("cancelled")
