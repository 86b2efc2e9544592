"""FidelityGuard: calibrated seams per block and shadow verification of live compose requests.

Both run off the hot path: a calibration is scheduled when a block is compiled, a shadow check
after a sampled response has completed, and both run as background work of the serving engine (its background
share, in steps of SKILLCACHE_BACKGROUND_CHUNK_TOKENS). A skill whose shadow check fails is marked degraded and
served by full prefill until recalibrated.
Deleting a skill (`forget`) drops its blocks' state, and jobs still in flight for them record nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from service import metrics
from service.config import Settings

if TYPE_CHECKING:
    from service.runtime.serving import ServingEngine
    from service.store.tiered import TieredStore

log = logging.getLogger(__name__)
_MAX_BACKLOG = 32
# background order (lowest first): calibrations (every request of a new skill uses the seam), then refinements
# (by expected benefit, negative: service/compose/refine.py), then the sampled shadow checks
CALIBRATION_PRIORITY, SHADOW_PRIORITY = -1e18, 1.0


class FidelityGuard:
    def __init__(self, settings: Settings, runtime, engine: "ServingEngine", store: "TieredStore") -> None:
        self.s, self.rt, self.engine, self.store = settings, runtime, engine, store
        self.degraded: dict[str, dict] = {}  # block key -> the failed shadow check
        self.shadow: dict[str, dict] = {}  # block key -> {"checks", "passed", "cosine_min", "cosine_mean"}
        self._bg: set[asyncio.Task] = set()
        self._calibrating: set[str] = set()  # block keys with a calibration in flight (one per key)
        self._deletes = 0  # forget() calls so far: a job notes the count when it is scheduled
        self._deleted: dict[str, int] = {}  # key -> _deletes when forgotten, while jobs are in flight
        self._writing = asyncio.Lock()  # a calibration writing its block back, or forget()
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

    def schedule_calibration(self, key, block, ephemeral: bool = False) -> None:
        """ephemeral: the block lives in the memory tier only (a request's tools block), and so does its
        calibration."""
        k = str(key)
        if self.s.seam_auto and calibration_of(block) is None and k not in self._calibrating:
            self._calibrating.add(k)
            if not self.spawn(self._calibrate(key, block, self._deletes, ephemeral)):
                self._calibrating.discard(k)  # the background backlog is full: a later request tries again

    async def _calibrate(self, key, block, since: int, ephemeral: bool = False) -> None:
        from service.runtime.calibrate import calibration_steps

        k = str(key)
        t0 = time.perf_counter()
        log.info("calibrating the seam of block %s (%d tokens), in the background ...", k, len(block.token_ids))
        try:
            cal = await self.run_background(calibration_steps(
                self.rt, block, list(self.s.seam_candidates), self.s.fidelity_min_cosine,
                self.s.fidelity_tie_margin, self.s.background_chunk_tokens), priority=CALIBRATION_PRIORITY)
            if cal is None:
                return  # the engine's background backlog was full: a later request schedules it again
            block.meta["calibration"] = json.dumps(cal.to_dict())
            metrics.CALIBRATIONS.labels("passed" if cal.passed else "whole_block").inc()
            log.info("calibrated block %s in %.1f s: %s", k, time.perf_counter() - t0,
                     f"seam {cal.seam} tokens" if cal.passed else "no seam passed, the whole block is recomputed")
            async with self._writing:
                if not self._current(k, since):
                    return  # its skill was deleted meanwhile: don't write the block back
                self.degraded.pop(k, None)
                metrics.DEGRADED_SKILLS.set(len(self.degraded))
                await self.store.put(key, block, ephemeral=ephemeral)  # the calibration travels with the block
        finally:
            self._calibrating.discard(k)

    async def forget(self, keys) -> None:
        """A skill was deleted: drop its blocks' shadow and degraded state. Jobs in flight for them record
        nothing, and a calibration writing its block back has finished when this returns (so the caller
        deletes the blocks after it)."""
        async with self._writing:
            self._deletes += 1
            for k in map(str, keys):
                self.degraded.pop(k, None)
                self.shadow.pop(k, None)
                if self._bg:
                    self._deleted[k] = self._deletes
            metrics.DEGRADED_SKILLS.set(len(self.degraded))

    def _current(self, key: str, since: int) -> bool:
        """False if the skill of `key` was deleted after a job was scheduled at `since`."""
        return self._deleted.get(key, -1) <= since

    # ---- shadow verification -----------------------------------------------------------------
    def maybe_shadow(self, keys: list[str], plan, blocks, seams) -> bool:
        if self.s.shadow_sample_rate <= 0 or random.random() >= self.s.shadow_sample_rate:
            return False
        self.spawn(self._shadow(keys, plan, blocks, seams, self._deletes))
        return True

    async def _shadow(self, keys, plan, blocks, seams, since: int) -> None:
        from service.runtime.fidelity import logit_agreement

        chunk = self.s.background_chunk_tokens

        def steps():  # the composed prefill, then the full one, in background steps of `chunk` tokens
            self.shadow_started.append(time.monotonic())  # on the engine, after the sampled response
            comp = yield from self.rt.prefill_steps(plan, blocks, mode="compose", seam_tokens=seams, chunk=chunk)
            _, full = yield from self.rt.full_prefill_steps(plan.ids, chunk)
            return comp.logits, full

        both = await self.run_background(steps(), priority=SHADOW_PRIORITY)
        if both is None:
            return  # the engine's background backlog was full: this sample is skipped
        composed, full = both
        fid = logit_agreement(composed, full, self.s.fidelity_tie_margin)
        ok = fid["cosine"] >= self.s.fidelity_min_cosine and (fid["top1_agree"] or not fid["decisive"])
        del self.shadow_started[:-100]
        metrics.SHADOW_CHECKS.labels("pass" if ok else "fail").inc()
        metrics.SHADOW_COSINE.observe(fid["cosine"])
        for k in keys:
            if not self._current(k, since):
                continue  # its skill was deleted meanwhile
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

    def report(self, key: str, meta: dict[str, str] | None) -> dict:
        """What the API shows for a block: its calibration (from the stored block's `meta`, None when there is no
        block) and this process's shadow checks and degraded flag."""
        st = self.shadow.get(key)
        shadow = None if st is None else {
            "checks": st["checks"], "passed": st["passed"], "cosine_min": st["cosine_min"],
            "cosine_mean": st["cosine_sum"] / st["checks"]}
        return {"calibration": calibration_in(meta), "shadow": shadow, "degraded": key in self.degraded}

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
        if not self._bg:
            self._deleted.clear()  # no job left that was scheduled before a delete
        if not task.cancelled() and task.exception() is not None:
            log.error("background fidelity job failed: %s", task.exception())

    async def run_background(self, steps, priority: float | Callable[[], float] = 0.0,
                             idle_only: Callable[[], bool] | None = None):
        """Run a step generator as background work of the engine; its value (None: the backlog was full)."""
        return await self.engine.run_steps(steps, background=True, priority=priority, idle_only=idle_only)

    async def drain(self) -> None:
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)


def calibration_of(block) -> dict | None:
    return calibration_in(block.meta if block is not None else None)


def calibration_in(meta: dict[str, str] | None) -> dict | None:
    raw = (meta or {}).get("calibration")
    return json.loads(raw) if raw else None
