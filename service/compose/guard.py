"""FidelityGuard: calibrated seams per block and shadow verification of live compose requests.

Both run off the hot path: a calibration is scheduled when a block is compiled, a shadow check
after a sampled response has completed. The engine's checks compute them (`checks`: the embedded engine's run on
this process's model, service/engines/embedded_checks.py; the vLLM engine's are vLLM requests,
service/vllm/checks.py); the guard decides when and records what they find. A skill whose shadow check fails is
marked degraded and served by full prefill until recalibrated.
Deleting a skill (`forget`) drops its blocks' state, and jobs still in flight for them record nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from service import metrics
from service.config import Settings
from service.kv.blockref import BlockRef

if TYPE_CHECKING:
    from service.runtime.serving import ServingLoop
    from service.store.tiered import TieredStore

log = logging.getLogger(__name__)
_MAX_BACKLOG = 32
class Checks(Protocol):
    """What an engine computes for the guard (RuntimeChecks, VllmChecks); shadow checks come as callables."""

    async def calibrate(self, key, block) -> Any:
        """The block's calibration (.seam, .passed, .to_dict()); None: not run now, a later request asks again."""


KEPT = 4096  # calibrations of blocks no store holds (an engine that keeps its own blocks: vLLM), in memory


class FidelityGuard:
    def __init__(self, settings: Settings, runtime, engine: "ServingLoop", store: "TieredStore") -> None:
        self.s, self.rt, self.engine, self.store = settings, runtime, engine, store
        self.degraded: dict[str, dict] = {}  # block key -> the failed shadow check
        self.shadow: dict[str, dict] = {}  # block key -> {"checks", "passed", "cosine_min", "cosine_mean"}
        self._bg: set[asyncio.Task] = set()
        self._calibrating: set[str] = set()  # block keys with a calibration in flight (one per key)
        self._deletes = 0  # forget() calls so far: a job notes the count when it is scheduled
        self._deleted: dict[str, int] = {}  # key -> _deletes when forgotten, while jobs are in flight
        self._writing = asyncio.Lock()  # a calibration writing its block back, or forget()
        self.shadow_started: list[float] = []  # monotonic start times of shadow checks (bounded below)
        self.checks: Checks | None = None  # the engine's (ComposePipeline.use_engine); None: none run
        self.calibrated: dict[str, dict] = {}  # key -> calibration of a block no store holds (the engine keeps it)

    # ---- seams -----------------------------------------------------------------------------
    def seam_for(self, key: str, block, requested: int | None) -> tuple[int | None, str]:
        """(seam, path): seam None means the skill is degraded and the request runs in full."""
        if requested is not None:
            return requested, "compose"
        if key in self.degraded:
            return None, "full"
        cal = calibration_of(block) or self.calibrated.get(key)
        if self.s.seam_auto and cal is not None:
            return int(cal["seam"]), "compose"
        return self.s.seam_tokens, "compose"

    def schedule_calibration(self, key, block, ephemeral: bool = False) -> None:
        """ephemeral: the block lives in the memory tier only (a request's tools block), and so does its
        calibration."""
        k = str(key)
        if (self.s.seam_auto and self.checks is not None and calibration_of(block) is None
                and k not in self.calibrated and k not in self._calibrating):
            self._calibrating.add(k)
            if not self.spawn(self._calibrate(key, block, self._deletes, ephemeral)):
                self._calibrating.discard(k)  # the background backlog is full: a later request tries again

    async def _calibrate(self, key, block, since: int, ephemeral: bool = False) -> None:
        k = str(key)
        t0 = time.perf_counter()
        log.info("calibrating the seam of block %s (%d tokens), in the background ...", k, len(block.token_ids))
        try:
            assert self.checks is not None
            cal = await self.checks.calibrate(key, block)
            if cal is None:
                return  # the engine's background backlog was full: a later request schedules it again
            metrics.CALIBRATIONS.labels("passed" if cal.passed else "whole_block").inc()
            log.info("calibrated block %s in %.1f s: %s", k, time.perf_counter() - t0,
                     f"seam {cal.seam} tokens" if cal.passed else "no seam passed, the whole block is recomputed")
            async with self._writing:
                if not self._current(k, since):
                    return  # its skill was deleted meanwhile: don't write the block back
                self.degraded.pop(k, None)
                metrics.DEGRADED_SKILLS.set(len(self.degraded))
                if isinstance(block, BlockRef):  # the engine keeps the block: its calibration stays here
                    self.calibrated[k] = cal.to_dict()
                    while len(self.calibrated) > KEPT:
                        self.calibrated.pop(next(iter(self.calibrated)))
                    return
                block.meta["calibration"] = json.dumps(cal.to_dict())
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
                self.calibrated.pop(k, None)
                if self._bg:
                    self._deleted[k] = self._deletes
            metrics.DEGRADED_SKILLS.set(len(self.degraded))

    def _current(self, key: str, since: int) -> bool:
        """False if the skill of `key` was deleted after a job was scheduled at `since`."""
        return self._deleted.get(key, -1) <= since

    # ---- shadow verification -----------------------------------------------------------------
    def maybe_shadow(self, keys: list[str], check) -> bool:
        """Sample a composed request for a shadow check: `check(started)` (the engine's, e.g. RuntimeChecks.shadow)
        compares it with a full prefill and returns {"ok", "top1_agree", "decisive", and "cosine" (logits) or "tv"
        (top-k distributions)}, or None (not run)."""
        if self.s.shadow_sample_rate <= 0 or random.random() >= self.s.shadow_sample_rate:
            return False
        self.spawn(self._shadow(keys, check, self._deletes))
        return True

    async def _shadow(self, keys, check, since: int) -> None:
        fid = await check(lambda: self.shadow_started.append(time.monotonic()))
        if fid is None:
            return  # the engine's background backlog was full: this sample is skipped
        ok = fid["ok"]
        del self.shadow_started[:-100]
        metrics.SHADOW_CHECKS.labels("pass" if ok else "fail").inc()
        if "cosine" in fid:
            metrics.SHADOW_COSINE.observe(fid["cosine"])
        for k in keys:
            if not self._current(k, since):
                continue  # its skill was deleted meanwhile
            st = self.shadow.setdefault(k, {"checks": 0, "passed": 0})
            st["checks"] += 1
            st["passed"] += int(ok)
            if "cosine" in fid:
                st["cosine_min"] = min(st.get("cosine_min", 1.0), fid["cosine"])
                st["cosine_sum"] = st.get("cosine_sum", 0.0) + fid["cosine"]
            if "tv" in fid:
                st["tv_max"] = max(st.get("tv_max", 0.0), fid["tv"])
                st["tv_sum"] = st.get("tv_sum", 0.0) + fid["tv"]
            if not ok:
                self.degraded[k] = fid
                log.warning("skill block %s failed a shadow check (%s): serving it by full prefill", k,
                            f"cosine {fid['cosine']:.5f}" if "cosine" in fid else f"top-1 {fid.get('top1_composed')!r}"
                            f" where a full prefill gives {fid.get('top1_full')!r}")
        metrics.DEGRADED_SKILLS.set(len(self.degraded))

    def report(self, key: str, meta: dict[str, str] | None) -> dict:
        """What the API shows for a block: its calibration (from the stored block's `meta`, None when there is no
        block) and this process's shadow checks and degraded flag."""
        st = self.shadow.get(key)
        shadow: dict | None = None
        if st is not None:
            shadow = {"checks": st["checks"], "passed": st["passed"]}
            if "cosine_sum" in st:
                shadow.update(cosine_min=st["cosine_min"], cosine_mean=st["cosine_sum"] / st["checks"])
            if "tv_sum" in st:  # vLLM: top-k distributions (service/vllm/fidelity.py)
                shadow.update(tv_max=st["tv_max"], tv_mean=st["tv_sum"] / st["checks"])
        return {"calibration": calibration_in(meta) or self.calibrated.get(key), "shadow": shadow,
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
