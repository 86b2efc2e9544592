"""Session turns on an engine that keeps the conversation's K/V itself (SKILLCACHE_ENGINE=vllm).

This process holds no cache for such a session. Every turn is the whole conversation, sent as one prepared
request (service/engines/): the session's head (its skills, tools block and base errata) composes exactly as for
/v1/compose, so every turn has the same head digest, hence the same composed head in the pool and the same
approximate salt; vLLM's prefix cache, under that salt, then holds the head and every earlier turn, and computes
only the new messages. Creating the session prefills the head there once (one token generated), so the first turn
is a prefix hit too. Should vLLM evict the conversation, it recomputes it on the composed head (loaded again from the
pool, or composed again: the same K/V). Once refinement has made the head exact (service/engines/vllm.py) turns go
out under the exact salt: vLLM recomputes the conversation once on the exact head, then hits again.

A session with a memory floats the memory before each user turn: the head then ends after the memory, so skillcache
composes the conversation so far into it on every turn (its text recomputed here, on one thread), and vLLM's
prefix cache does not carry earlier turns. Sessions without a memory do not pay that.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from service.compose.pipeline import ComposeParams, Final, Prepared
from service.runtime.params import GenParams


class EngineTurns:
    def __init__(self, pipeline) -> None:
        self.p = pipeline

    async def create(self, s, plan, blocks: list, seams: list[int], mode: str) -> dict:
        """Prefill the session's head on the engine (one token generated, discarded); the usage of turn 0."""
        box: dict = {}
        prep = self._prepared(s, plan, blocks, seams, mode, GenParams(max_tokens=1), None, None, time.perf_counter())
        events = await self.p.runner.start(prep, _finisher(box))
        async for _ in events:
            pass
        pre = box["pre"]
        return {"prompt_tokens": pre.n_prompt, "reused_tokens": pre.n_reused + pre.n_prefix,
                "recomputed_tokens": pre.n_recomputed}

    async def start(self, s, plan, blocks: list, seams: list[int], mode: str, gen: GenParams, tools, late,
                    t0: float) -> tuple[AsyncGenerator, dict]:
        """Start a turn: its events (Delta..., then a Final whose usage and timings `report` fills) and a box that
        holds the engine's counts once the turn is done. Errors before the first token raise here."""
        box: dict = {"t0": t0, "late": late, "store_ms": (time.perf_counter() - t0) * 1e3}  # the memory's blocks
        prep = self._prepared(s, plan, blocks, seams, mode, gen, tools, late, t0)
        return await self.p.runner.start(prep, _finisher(box)), box

    def _prepared(self, s, plan, blocks, seams, mode, gen, tools, late, t0: float) -> Prepared:
        blocks, seams = list(blocks), list(seams)
        if late is not None:  # a memory: its blocks follow the skills' and the tools block, with their own seams
            blocks.extend(late.blocks)
            seams.extend(late.seams)
        params = ComposeParams([], [], gen=gen, mode=mode, namespace=s.namespace, tools=None, late=late)
        return Prepared(params, [], blocks, [], [], plan, t0, 0.0, [], seams, [], mode, None, tools)


async def relay(events: AsyncGenerator, box: dict, ended, release) -> AsyncIterator:
    """A started turn's events, its Final replaced by `ended(final, usage, timings)` (the session's Final);
    `release()` once it ends, however it ends (the session's lock)."""
    try:
        yield None  # the caller starts us here: an async generator closed before it started runs no `finally`
        async for item in events:
            if isinstance(item, Final):
                usage, timings = report(box, len(item.done.token_ids))
                yield ended(item, usage, timings)
                return
            yield item
    finally:
        release()
        await events.aclose()  # a client gone mid-reply: vLLM's stream is closed, the request aborted


def report(box: dict, n_completion: int) -> tuple[dict, dict]:
    """A finished turn's usage and timings, shaped as the embedded engine's session turns report them: what the
    engine did not compute is reused (composed: the head's tokens loaded this turn, when a memory made the head)."""
    pre, late = box["pre"], box["late"]
    reused = pre.n_reused + pre.n_prefix
    composed = pre.n_reused if late is not None else 0
    usage = {"prompt_tokens": pre.n_prompt, "reused_tokens": reused, "composed_tokens": composed,
             "prefix_tokens": reused - composed, "recomputed_tokens": pre.n_recomputed,
             "completion_tokens": n_completion}
    timings = {"ttft_ms": round(box["ttft_ms"], 2), "compose_ms": round(pre.timings_ms.get("prefill_ms", 0.0), 2),
               "store_ms": round(box["store_ms"], 2),
               "total_ms": round((time.perf_counter() - box["t0"]) * 1e3, 2)}
    return usage, timings


def _finisher(box: dict):
    """The engine's `finish`: keeps its counts in `box`; the session builds its own Final from them."""

    def finish(prep, done, pre, ttft_ms: float) -> Final:
        box.update(pre=pre, ttft_ms=ttft_ms)
        return Final(done, {}, {}, [], [])

    return finish

