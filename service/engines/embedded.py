"""EmbeddedEngine: a prepared request runs on this process's serving engine (service/runtime/serving).

The prompt's cache is built by the runtime's prefill steps (composition, or the full prefill), the text tail and
decode run batched with other requests. Refinement is this engine's: an order composed often enough is prefilled
exactly in the background (service/compose/refine.py) and served as an exact prefix from then on; a request that runs
in full donates its K/V to a refinement that wants it. Shadow checks (service/compose/guard.py) compare composed
and full logits after the response. Automatic heads (service/compose/auto.py): each prompt's exact K/V is kept when
its sequence joins the batch, and a later prompt of the tenant that opens with it copies the longest one first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from service.compose.blocks import StoreBlocks
from service.engines.embedded_checks import RuntimeChecks
from service.engines.embedded_turns import EmbeddedTurns
from service.runtime.params import Delta, Done
from service.tools.events import parsed

if TYPE_CHECKING:
    from service.compose.auto import AutoHeads
    from service.compose.engine import Engine
    from service.kv.block import KVBlock
    from service.kv.radix import HeadMatch
    from service.compose.pipeline import Final, Prepared
    from service.runtime.steps import PrefillResult


class EmbeddedEngine:
    def __init__(self, settings, runtime, serving, store, refiner, guard, auto: "AutoHeads | None" = None) -> None:
        self.settings = settings
        self.rt = runtime
        self.serving = serving
        self.refiner = refiner
        self.guard = guard
        self.checks = RuntimeChecks(settings, runtime, guard.run_background)  # calibrations, shadow checks
        self.auto = auto  # automatic exact heads (service/compose/auto.py); None or disabled: off
        self.blocks = StoreBlocks(settings, runtime, serving, store, guard)  # compiled here, kept in the store's tiers

    def session_turns(self, pipeline, memories) -> EmbeddedTurns:
        """Each session holds its conversation's cache here; a turn extends it (service/engines/embedded_turns.py)."""
        return EmbeddedTurns(pipeline, memories)

    async def health(self) -> bool:
        return True  # the model thread is this process: /livez covers it

    async def close(self) -> None:
        return None

    async def start(self, prep: "Prepared", finish) -> AsyncIterator["Delta | Final"]:
        """Submit to the serving engine and wait for the first event; returns the event stream."""
        box: dict = {}
        donate = await self.refiner.wanted(prep.params.namespace, prep.plan) if prep.mode == "full" else 0
        loop = asyncio.get_running_loop()
        typed = prep.params.gen.json_schema is not None or (prep.tools is not None and prep.tools.options)
        if typed:  # a typed reply or a forced call's arguments: the grammar's vocabulary, once, off the model
            from service.runtime.grammar import vocab_ready  # thread (seconds: every stream would stall behind it)

            await asyncio.to_thread(vocab_ready, self.rt)

        def on_prefilled(pre: "PrefillResult") -> None:  # on the engine, before the first token is sampled
            box["ttft_ms"] = (time.perf_counter() - prep.t_start) * 1e3
            box["pre"] = pre
            if donate and pre.cache is not None:  # its K/V through a head refinement wants are that head's exact prefix
                from service.kv.cache import block_from_cache

                block = block_from_cache(pre.cache, prep.plan.ids[:donate], self.rt.fingerprint)
                coro = self.refiner.donate(prep.params.namespace, prep.plan, block)
                loop.call_soon_threadsafe(self.guard.spawn, coro)

        auto = self.auto if self.auto is not None and self.auto.enabled else None
        steps = self._prefill(prep, auto)
        n_prompt = prep.plan.n_tokens
        if prep.tools is not None:
            steps, n_prompt = prep.tools.steps(self.rt, steps), n_prompt + prep.tools.extra_tokens()
        on_joined = None
        if auto is not None:
            ns, plan = prep.params.namespace, prep.plan

            def on_joined(pre: "PrefillResult") -> None:  # on the engine: the prompt's K/V are final
                # store K/V in it: a block, or a refined prefix (not exact under int8 tiers: AutoHeads.keep)
                auto.keep(ns, plan, pre, prep.mode == "compose" and (bool(prep.blocks) or pre.n_prefix > pre.n_auto))

        job = self.serving.submit_sequence(steps, prep.params.gen, n_prompt, on_prefilled=on_prefilled,
                                           on_joined=on_joined)
        stream = job.stream()
        first = await anext(stream)  # prefill errors surface here, before any byte is sent
        events = self._events(prep, first, stream, box, finish)
        parser = prep.tools.parser() if prep.tools is not None else None  # after the prefill: its choice made
        return parsed(events, parser) if parser is not None else events

    def _prefill(self, prep: "Prepared", auto: "AutoHeads | None"):
        """The request's prefill steps; first (on the engine, in the first step) the longest automatic head its
        prompt opens with, when it is longer than the refined prefix `prepare` found."""
        prefix: "KVBlock | HeadMatch | None" = prep.prefix
        n_auto = 0
        if auto is not None and prep.mode == "compose":
            hit = auto.match(prep.params.namespace, prep.plan)
            if hit is not None and hit.n_tokens > (prefix.n_tokens if prefix is not None else 0):
                prefix, n_auto = hit, hit.n_tokens
        # the text tail is left to the engine (run together with other requests' tails), unless a tool opening
        # continues the prefill after it
        pre = yield from self.rt.prefill_steps(prep.plan, prep.blocks, mode=prep.mode, seam_tokens=prep.seams,
                                               prefix=prefix, chunk=self.settings.prefill_chunk_tokens,
                                               defer_tail=prep.tools is None)
        pre.n_auto = n_auto
        return pre

    async def _events(self, prep: "Prepared", first, stream, box, finish) -> AsyncIterator["Delta | Final"]:
        item = first
        while True:
            if isinstance(item, Done):
                yield finish(prep, item, box["pre"], box["ttft_ms"])
                if prep.mode == "compose":  # after the response: never on the sampled request's clock
                    if prep.params.late is None:  # a shadow check is the skills': a memory's is bench/memory.py
                        self.guard.maybe_shadow(prep.keys, self.checks.shadow(prep.plan, prep.blocks, prep.seams))
                    self.refiner.note(prep.params.namespace, prep.plan, box["pre"].n_prefix)
                return
            yield item
            item = await anext(stream)


if TYPE_CHECKING:
    def _is_an_engine(e: EmbeddedEngine) -> Engine:
        return e  # mypy checks EmbeddedEngine against the Engine protocol here
