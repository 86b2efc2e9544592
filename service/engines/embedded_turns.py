"""Session turns on this process's engine: the session holds its conversation's cache, and each turn extends it with
the new tokens only (service/runtime: extend_steps; with a memory, late_turn_steps floats it before the user turn
and takes it out of the cache again when the turn is done)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from service.compose.turns import Turn, opened
from service.runtime.params import Delta, Done
from service.tools.events import parsed


class EmbeddedTurns:
    def __init__(self, pipeline, memories) -> None:
        self.p = pipeline
        self.rt = pipeline.rt
        self.memories = memories

    async def open(self, s, prep) -> dict:
        """Prefill the head into the session's own cache."""
        pre = await self.p.engine.run_steps(self.rt.prefill_steps(
            prep.plan, prep.blocks, mode=prep.mode, seam_tokens=prep.seams, prefix=prep.prefix,
            chunk=self.p.settings.prefill_chunk_tokens))
        if prep.mode == "compose":
            self.p.refiner.note(prep.params.namespace, prep.plan, pre.n_prefix)
        s.cache = pre.cache
        return opened(pre)

    async def start(self, s, turn: Turn) -> AsyncIterator:
        """Submit the turn and wait for its first event."""
        t0, late, tools, ids = turn.t0, turn.late, turn.tools, turn.plan.ids
        box: dict = {"store_ms": (time.perf_counter() - t0) * 1e3}  # the memory's blocks
        cached_ids, s.ids = s.ids, []  # until the turn ends, the cache is trusted for no ids: it is being extended

        def on_prefilled(pre) -> None:  # on the engine
            box.update(ttft_ms=(time.perf_counter() - t0) * 1e3, pre=pre)

        chunk = self.p.settings.prefill_chunk_tokens
        if late is not None:
            from service.runtime.late import late_turn_steps  # torch: the API imports this module
            steps = late_turn_steps(self.rt, s.cache, cached_ids, turn.plan, late.blocks, late.seams, chunk)
        else:
            steps = self.rt.extend_steps(s.cache, cached_ids, ids, chunk=chunk)
        n_prompt = len(ids)
        if tools is not None:
            steps, n_prompt = tools.steps(self.rt, steps), n_prompt + tools.extra_tokens()
        job = self.p.engine.submit_sequence(steps, turn.gen, n_prompt, keep_cache=True, on_prefilled=on_prefilled)
        stream = job.stream()
        try:
            first = await anext(stream)
        except BaseException:
            await stream.aclose()
            raise
        events = _after(first, stream)
        parser = tools.parser() if tools is not None else None
        return self._relay(s, turn, parsed(events, parser) if parser is not None else events, stream, box, job)

    async def _relay(self, s, turn: Turn, events, stream, box: dict, job) -> AsyncIterator:
        """The turn's events; at its Done the session takes the cache, and `turn.ended` gives the Final."""
        late, tools = turn.late, turn.tools
        try:
            yield None  # started: an async generator closed before it started runs no `finally`
            async for item in events:
                if isinstance(item, Done):
                    # the cache holds every forwarded token: the last sampled one may not be
                    s.cache = job.cache
                    tail = tools.tail_ids if tools is not None else []  # a tool chosen for `required`
                    ids = turn.plan.ids + tail + item.token_ids
                    if late is not None:  # the memory leaves the conversation's cache: floated again next turn
                        ids = await self.memories.leave(s.cache, ids, turn.plan.late_span)
                    s.ids = ids[: s.cache.get_seq_length()]
                    yield turn.end(item, box["pre"], box["ttft_ms"], box["store_ms"])
                    return
                yield item
        finally:
            turn.release()
            await stream.aclose()  # a client gone mid-reply: stop generating now


async def _after(first, stream: AsyncIterator) -> AsyncIterator[Delta | Done]:
    """`first`, then the rest of `stream`."""
    yield first
    async for item in stream:
        yield item
