"""The embedded engine's fidelity checks: seam calibration and shadow checks run on this process's model, as
background work of the serving engine (its background share, in steps of SKILLCACHE_BACKGROUND_CHUNK_TOKENS).

The FidelityGuard (service/compose/guard.py) decides when a check runs and what its result changes; an engine's
checks only compute it (the vLLM engine's: service/vllm/checks.py).
"""

from __future__ import annotations

from collections.abc import Callable

from service.compose import background  # the order of background work (calibrations first, shadow checks last)


class RuntimeChecks:
    def __init__(self, settings, runtime, run_background) -> None:
        self.s, self.rt, self.run_background = settings, runtime, run_background

    async def calibrate(self, key, block):
        """The block's Calibration (service/runtime/calibrate.py), None when the background backlog was full."""
        from service.runtime.calibrate import calibration_steps

        return await self.run_background(calibration_steps(
            self.rt, block, list(self.s.seam_candidates), self.s.fidelity_min_cosine,
            self.s.fidelity_tie_margin, self.s.background_chunk_tokens), priority=background.CALIBRATION)

    def shadow(self, plan, blocks, seams) -> Callable:
        """The shadow check of one composed request: an async callable that compares its composed first-token logits
        with a full prefill's ({"cosine", "top1_agree", "decisive", "ok"}; None: the backlog was full)."""
        chunk = self.s.background_chunk_tokens

        async def check(started: Callable[[], None]) -> dict | None:
            from service.runtime.fidelity import logit_agreement

            def steps():  # the composed prefill, then the full one, in background steps of `chunk` tokens
                started()  # on the engine, after the sampled response
                comp = yield from self.rt.prefill_steps(plan, blocks, mode="compose", seam_tokens=seams, chunk=chunk)
                _, full = yield from self.rt.full_prefill_steps(plan.ids, chunk)
                return comp.logits, full

            both = await self.run_background(steps(), priority=background.SHADOW_CHECK)
            if both is None:
                return None
            fid = logit_agreement(both[0], both[1], self.s.fidelity_tie_margin)
            fid["ok"] = fid["cosine"] >= self.s.fidelity_min_cosine and (fid["top1_agree"] or not fid["decisive"])
            return fid

        return check
