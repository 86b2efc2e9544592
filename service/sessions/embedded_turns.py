"""Session turns on this process's engine: the session holds its conversation's cache, and each turn extends it with
the new tokens only (service/runtime: extend_steps; with a memory, late_turn_steps floats it before the user turn
and takes it out of the cache again when the turn is done)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from service.runtime.params import Delta, Done, GenParams
from service.tools.events import parsed


class EmbeddedTurns:
    def __init__(self, pipeline, memories) -> None:
        self.p = pipeline
        self.rt = pipeline.rt
        self.memories = memories

    async def start(self, s, ids: list[int], gen: GenParams, tools, late=None, t0: float | None = None):
        """Submit the turn and wait for its first event. `late`: (plan, LateMemory) when the session floats a memory
        before the user turn."""
        t0 = time.perf_counter() if t0 is None else t0
        box: dict = {"ids": ids, "late": late, "store_ms": (time.perf_counter() - t0) * 1e3}
        cached_ids, s.ids = s.ids, []  # until the turn ends, the cache is trusted for no ids: it is being extended

        def on_prefilled(pre) -> None:  # on the engine
            box.update(ttft_ms=(time.perf_counter() - t0) * 1e3, reused=pre.n_reused + pre.n_prefix,
                       recomputed=pre.n_recomputed, composed=pre.n_reused if late else 0, seams=pre.seams)

        chunk = self.p.settings.prefill_chunk_tokens
        if late is not None:
            from service.runtime.late import late_turn_steps  # torch: the API imports this module
            steps = late_turn_steps(self.rt, s.cache, cached_ids, late[0], late[1].blocks, late[1].seams, chunk)
        else:
            steps = self.rt.extend_steps(s.cache, cached_ids, ids, chunk=chunk)
        n_prompt = len(ids)
        if tools is not None:
            steps, n_prompt = tools.steps(self.rt, steps), n_prompt + tools.extra_tokens()
        job = self.p.engine.submit_sequence(steps, gen, n_prompt, keep_cache=True, on_prefilled=on_prefilled)
        stream = job.stream()
        first = await anext(stream)
        events = _after(first, stream)
        parser = tools.parser() if tools is not None else None
        return (parsed(events, parser) if parser is not None else events), stream, box, t0, job, tools

    async def relay(self, s, run, ended) -> AsyncIterator:
        """The turn's events; at its Done the session takes the cache, and `ended(done, usage, timings, memory)` gives
        the Final. Releases the session's lock however it ends."""
        events, stream, box, t0, job, tools = run
        try:
            yield None  # turn() starts us here: an async generator closed before it started runs no `finally`
            async for item in events:
                if isinstance(item, Done):
                    # the cache holds every forwarded token: the last sampled one may not be
                    s.cache = job.cache
                    tail = tools.tail_ids if tools is not None else []  # a tool chosen for `required`
                    ids = box["ids"] + tail + item.token_ids
                    if box["late"] is not None:  # the memory leaves the conversation's cache: floated again next turn
                        ids = await self.memories.leave(s.cache, ids, box["late"][0].late_span)
                    s.ids = ids[: s.cache.get_seq_length()]
                    usage = {"prompt_tokens": box["reused"] + box["recomputed"], "reused_tokens": box["reused"],
                             "composed_tokens": box["composed"], "prefix_tokens": box["reused"] - box["composed"],
                             "recomputed_tokens": box["recomputed"], "completion_tokens": len(item.token_ids)}
                    timings = {"ttft_ms": round(box["ttft_ms"], 2), "compose_ms": round(box["ttft_ms"], 2),
                               "store_ms": round(box["store_ms"], 2),
                               "total_ms": round((time.perf_counter() - t0) * 1e3, 2)}
                    memory = box["late"][1].report(box["seams"], late_index(*box["late"])) if box["late"] else None
                    yield ended(item, usage, timings, memory)
                    return
                yield item
        finally:
            s.lock.release()
            await stream.aclose()  # a client gone mid-reply: stop generating now


async def _after(first, stream: AsyncIterator) -> AsyncIterator[Delta | Done]:
    """`first`, then the rest of `stream`."""
    yield first
    async for item in stream:
        yield item


def late_index(plan, late) -> int:
    """The index of the first late block: they are the plan's last skill segments, after the skills and tools."""
    return [seg for seg in plan.segments if seg.kind == "skill"][-len(late.blocks)].skill_index
