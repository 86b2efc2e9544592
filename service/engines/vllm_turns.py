"""Session turns on vLLM, which keeps the conversation's K/V itself.

This process holds no cache for such a session. Every turn is the whole conversation, sent as one prepared
request (service/engines/vllm.py): the session's head (its skills, tools block and base errata) composes exactly as
for /v1/compose, so every turn has the same head digest, hence the same composed head and the same approximate salt;
vLLM's prefix cache, under that salt, then holds the head and every earlier turn, and computes only the new
messages. Opening the session prefills the head there once (one token generated), so the first turn is a prefix hit
too. Should vLLM evict the conversation, it recomputes it on the composed head (loaded again, or composed again: the
same K/V). Once refinement has made the head exact, turns go out under the exact salt: vLLM recomputes the
conversation once on the exact head, then hits again.

A session with a memory floats the memory before each user turn: the head then ends after the memory, so the
conversation so far is composed into it on every turn, and vLLM's prefix cache does not carry earlier turns.
Sessions without a memory do not pay that.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from service.compose.pipeline import ComposeParams, Final, Prepared
from service.compose.turns import Turn, opened
from service.runtime.params import GenParams


class VllmTurns:
    def __init__(self, pipeline) -> None:
        self.p = pipeline

    async def open(self, s, prep) -> dict:
        """Prefill the session's head on vLLM (one token generated, discarded)."""
        box: dict = {}
        turn0 = self._prepared(s, prep.plan, prep.blocks, prep.seams, prep.mode, GenParams(max_tokens=1), None, None,
                               time.perf_counter())
        events = await self.p.runner.start(turn0, _finisher(box))
        async for _ in events:
            pass
        pre = box["pre"]
        return opened(pre)

    async def start(self, s, turn: Turn) -> AsyncIterator:
        """Send the whole conversation; errors before the first token raise here."""
        blocks, seams, mode = await turn.head()
        box: dict = {"store_ms": (time.perf_counter() - turn.t0) * 1e3}  # the head's and the memory's blocks
        prep = self._prepared(s, turn.plan, blocks, seams, mode, turn.gen, turn.tools, turn.late, turn.t0)
        events = await self.p.runner.start(prep, _finisher(box))
        return self._relay(s, turn, events, box)

    def _prepared(self, s, plan, blocks, seams, mode, gen, tools, late, t0: float) -> Prepared:
        blocks, seams = list(blocks), list(seams)
        if late is not None:  # a memory: its blocks follow the skills' and the tools block, with their own seams
            blocks.extend(late.blocks)
            seams.extend(late.seams)
        params = ComposeParams([], [], gen=gen, mode=mode, namespace=s.namespace, tools=None, late=late)
        return Prepared(params, [], blocks, [], [], plan, t0, 0.0, [], seams, [], mode, None, tools)

    async def _relay(self, s, turn: Turn, events: AsyncGenerator, box: dict) -> AsyncIterator:
        """The turn's events, its Final replaced by the session's; what the engine did not compute is reused
        (composed: the head's tokens loaded this turn, when a memory made the head)."""
        tools = turn.tools
        try:
            yield None  # started: an async generator closed before it started runs no `finally`
            async for item in events:
                if isinstance(item, Final):
                    s.ids = turn.plan.ids + (tools.tail_ids if tools is not None else []) + item.done.token_ids
                    yield turn.end(item.done, box["pre"], box["ttft_ms"], box["store_ms"])
                    return
                yield item
        finally:
            turn.release()
            await events.aclose()  # a client gone mid-reply: vLLM's stream is closed, the request aborted


def _finisher(box: dict):
    """The engine's `finish`: keeps its counts in `box`; the session builds its own Final from them."""

    def finish(prep, done, pre, ttft_ms: float) -> Final:
        box.update(pre=pre, ttft_ms=ttft_ms)
        return Final(done, {}, {}, [], [])

    return finish
