"""FidelityGuard: calibrated seams per block and shadow verification of live compose requests.

Both run off the hot path: a calibration is scheduled when a block is compiled, a shadow check
after a sampled response has completed, and each waits until the inference worker is idle. A
skill whose shadow check fails is marked degraded and served by full prefill until recalibrated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import TYPE_CHECKING

from service import metrics
from service.config import Settings

if TYPE_CHECKING:
    from service.runtime.worker import InferenceWorker
    from service.store.tiered import TieredStore

log = logging.getLogger(__name__)
_MAX_BACKLOG = 32


class FidelityGuard:
    def __init__(self, settings: Settings, runtime, worker: "InferenceWorker", store: "TieredStore") -> None:
        self.s, self.rt, self.worker, self.store = settings, runtime, worker, store
        self.degraded: dict[str, dict] = {}  # block key -> the failed shadow check
        self.shadow: dict[str, dict] = {}  # block key -> {"checks", "passed", "cosine_min", "cosine_mean"}
        self._bg: set[asyncio.Task] = set()
        self._idle = asyncio.Lock()  # one background job at a time
        self.shadow_started: list[float] = []  # monotonic start times of shadow checks (bounded below)

    # ---- seams -----------------------------------------------------------------------------
    def seam_for(self, key: str, block, requested: int | None) -> tuple[int | None, str]:
        """(seam, path): seam None means the skill is degraded and the request runs in full."""
        if requested is not None:
            return requested, "compose"
        if key in self.degraded:
            return None, "full"
        cal = calibration_of(block)
        if self.s.seam_auto and cal is not None:
            return int(cal["seam"]), "compose"
        return self.s.seam_tokens, "compose"

    def schedule_calibration(self, key, block) -> None:
        if self.s.seam_auto and calibration_of(block) is None:
            self.spawn(self._calibrate(key, block))

    async def _calibrate(self, key, block) -> None:
        from service.runtime.calibrate import calibration_steps

        cal = await self.run_steps(calibration_steps(
            self.rt, block, list(self.s.seam_candidates), self.s.fidelity_min_cosine, self.s.fidelity_tie_margin,
            self.s.background_chunk_tokens))
        block.meta["calibration"] = json.dumps(cal.to_dict())
        metrics.CALIBRATIONS.labels("passed" if cal.passed else "whole_block").inc()
        self.degraded.pop(str(key), None)
        metrics.DEGRADED_SKILLS.set(len(self.degraded))
        await self.store.put(key, block)  # the calibration travels with the block (disk, Redis)

    # ---- shadow verification -----------------------------------------------------------------
    def maybe_shadow(self, keys: list[str], plan, blocks, seams) -> bool:
        if self.s.shadow_sample_rate <= 0 or random.random() >= self.s.shadow_sample_rate:
            return False
        self.spawn(self._shadow(keys, plan, blocks, seams))
        return True

    async def _shadow(self, keys, plan, blocks, seams) -> None:
        from service.runtime.fidelity import logit_agreement

        def composed(cancelled):
            self.shadow_started.append(time.monotonic())  # on the worker, after the sampled response
            return self.rt.prefill(plan, blocks, mode="compose", seam_tokens=seams).logits

        # the composed prefill, then the full one in chunks, each step in its own idle slot
        comp = await self.when_idle(composed)
        _, full = await self.run_steps(self.rt.full_prefill_steps(plan.ids, self.s.background_chunk_tokens))
        fid = logit_agreement(comp, full, self.s.fidelity_tie_margin)
        ok = fid["cosine"] >= self.s.fidelity_min_cosine and (fid["top1_agree"] or not fid["decisive"])
        del self.shadow_started[:-100]
        metrics.SHADOW_CHECKS.labels("pass" if ok else "fail").inc()
        metrics.SHADOW_COSINE.observe(fid["cosine"])
        for k in keys:
            st = self.shadow.setdefault(k, {"checks": 0, "passed": 0, "cosine_min": 1.0, "cosine_sum": 0.0})
            st["checks"] += 1
            st["passed"] += int(ok)
            st["cosine_min"] = min(st["cosine_min"], fid["cosine"])
            st["cosine_sum"] += fid["cosine"]
            if not ok:
                self.degraded[k] = fid
                log.warning("skill block %s failed a shadow check (cosine %.5f): serving it by full prefill", k,
                            fid["cosine"])
        metrics.DEGRADED_SKILLS.set(len(self.degraded))

    def report(self, key: str, block) -> dict:
        st = self.shadow.get(key)
        shadow = None if st is None else {
            "checks": st["checks"], "passed": st["passed"], "cosine_min": st["cosine_min"],
            "cosine_mean": st["cosine_sum"] / st["checks"]}
        return {"calibration": calibration_of(block) if block is not None else None, "shadow": shadow,
                "degraded": key in self.degraded}

    # ---- background plumbing -----------------------------------------------------------------
    def spawn(self, coro) -> bool:
        """Run `coro` in the background (False: the backlog is full and it was dropped, unrun)."""
        if len(self._bg) >= _MAX_BACKLOG:
            coro.close()
            return False
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._done)
        return True

    def _done(self, task: asyncio.Task) -> None:
        self._bg.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background fidelity job failed: %s", task.exception())

    async def when_idle(self, fn):
        """Run fn(cancelled) on the worker once it is idle; one background job at a time."""
        async with self._idle:
            while self.worker.busy or self.worker.queue.qsize() > 0:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)  # and still idle a moment later (not between two requests)
            while self.worker.busy or self.worker.queue.qsize() > 0:
                await asyncio.sleep(0.05)
            return await self.worker.run(fn)

    async def run_steps(self, steps):
        """Drive a step generator (runtime full_prefill_steps, calibration_steps...): each step on the worker in
        its own idle slot, its result sent back. Returns the generator's value."""
        result = None
        try:
            while True:
                step = steps.send(result)
                result = await self.when_idle(lambda cancelled, step=step: step())
        except StopIteration as done:
            return done.value

    async def drain(self) -> None:
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)


def calibration_of(block) -> dict | None:
    raw = block.meta.get("calibration") if block is not None else None
    return json.loads(raw) if raw else None
