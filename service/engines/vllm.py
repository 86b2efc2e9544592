"""VllmEngine: a prepared request runs on a vLLM server; vLLM computes every token, its connector moves K/V.

compose: the head (every prompt token up to the last block's copied end) is planned here (service/vllm/chain.py) and
built inside vLLM: each block is compiled once by vLLM (a request of the block in its canonical context whose K/V
the connector saves: service/vllm/connector.py), the tokens computed between copies (seams, edited spans, the text
between blocks) are a short chain of vLLM steps whose K/V are saved too, and the final request loads the whole head
(copies re-rotated to their offsets by the connector) and vLLM computes the text after it. No K/V passes through
this process. The salt `approx:<namespace>:<digest of the composition>` keeps composed K/V in vLLM's prefix cache for
the same composition only: a repeat hits there, and no exact request, no other tenant and no other composition ever
reads them.
Refinement: once a composition has been served composed SKILLCACHE_VLLM_REFINE_AFTER times, its next request goes
out exact (under `exact:<namespace>:<digest>`, the order's own, nothing loaded): vLLM prefills the whole prompt as
vLLM alone would, a live request at live priority, and no background prefill is ever sent for it (one vLLM cannot
interrupt held a live request's first token 2.2 s: docs/BENCHMARKS.md); from then on the order goes out exact and
vLLM's own prefix cache serves the head, from that whole-prompt prefill only (K/V computed against a cached prefix
round differently in bfloat16). It buys vLLM's own numbers, not speed (a composed repeat loads its head to the exact
token, a refined one hits vLLM's prefix cache in whole blocks: it computes more), so the default count is high (64).
mode=full: `exact:<namespace>`, nothing loaded.
Automatic reuse is vLLM's own prefix cache under the exact salt, reported as `auto_tokens`.
Replicas (SKILLCACHE_VLLM_URL lists several): a composition goes to the first replica, in the rendezvous order of its
digest (a request with no composed head: of its tenant and first tokens), that answers (service/vllm/client.py,
VllmPool): its compiles, steps and final request alike, so its records and its prefix-cache entries are on that
replica; a replica that fails before the first token sends the request on to the next in that order. What vLLM has
saved is known per replica, unless the replicas share their records (SKILLCACHE_VLLM_SHARED_SPANS: Redis behind each
spans dir, service/vllm/spans.py): then per record, and a block the shared index already holds is not compiled again
(by this process, another skillcache, or after a restart).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from service import metrics
from service.errors import EngineUnavailable
from service.runtime.params import Delta, Done
from service.engines.vllm_blocks import VllmBlocks
from service.engines.vllm_turns import VllmTurns
from service.tools.events import parsed
from service.vllm.background import Background, approx_salt, exact_salt, refined_salt
from service.vllm.chain import Chain
from service.vllm.checks import VllmChecks
from service.vllm.client import Usage, VllmClient, VllmPool
from service.vllm.heads import VllmHeads, touch

if TYPE_CHECKING:
    from service.compose.guard import FidelityGuard
    from service.compose.pipeline import Final, Prepared
    from service.compose.engine import Engine

log = logging.getLogger(__name__)
ROUTE_TOKENS = 256  # a request with no composed head is routed by its tenant and this many first tokens


class VllmEngine:
    def __init__(self, settings, runtime, serving_engine=None, client: VllmClient | None = None,
                 pool: VllmPool | None = None, shared=None) -> None:
        self.settings = settings
        self.rt = runtime  # its tokenizer's anchor and fingerprint; vLLM runs the model
        pool = pool or (VllmPool([client]) if client is not None else
                        VllmPool.from_urls(settings.vllm_urls, settings.vllm_model, settings.vllm_timeout_s))
        if shared is None and getattr(settings, "vllm_spans_redis", None):
            from service.vllm.spans import SharedIndex

            shared = SharedIndex(settings.vllm_spans_redis)
        self.shared = shared  # the shared spans tier's index (None: each replica's spans dir alone)
        self.refine_after = settings.vllm_refine_after
        self._seen: OrderedDict[str, int] = OrderedDict()  # composition digest -> times served
        # live requests in flight; background work waits for a quiet moment
        self.bg = Background(settings.vllm_background_chunk, settings.background_idle_ms / 1e3)
        self.heads = VllmHeads(runtime, pool, shared, self.bg)  # what vLLM has saved, how heads get built
        self.checks = VllmChecks(settings, runtime, self.heads, self.bg)  # calibrations, shadow checks: vLLM requests
        self.guard: "FidelityGuard | None" = None  # the pipeline's (ComposePipeline.use_engine): samples shadow checks
        self.blocks = VllmBlocks(self, len(runtime.anchor))  # BlockRefs: vLLM compiles them, its connector keeps them

    @property
    def pool(self) -> VllmPool:
        """The replicas (what vLLM saved is known per replica unless a shared tier holds the records)."""
        return self.heads.pool

    @pool.setter
    def pool(self, pool: VllmPool) -> None:
        self.heads.pool = pool

    @property
    def client(self):
        """The first replica (the only one, unless SKILLCACHE_VLLM_URL lists several)."""
        return self.pool.clients[0]

    @client.setter
    def client(self, client) -> None:
        self.pool = VllmPool([client])

    async def _failover(self, route: str, call):
        """`call(client)` on the route's replicas in order, until one answers (EngineUnavailable: the next)."""
        last: EngineUnavailable | None = None
        for client in self.pool.order(route):
            try:
                out = await call(client)
            except EngineUnavailable as e:
                self.pool.failed(client)
                if len(self.pool.clients) > 1:
                    metrics.VLLM_FAILOVERS.labels(self.pool.name(client)).inc()
                    log.warning("vLLM replica %s failed (%s); trying the next", self.pool.name(client), e)
                last = e
                continue
            self.pool.ok(client)
            return out
        assert last is not None
        raise last

    def session_turns(self, pipeline, memories) -> VllmTurns:
        """Each turn sends the whole conversation: vLLM's prefix cache holds it (service/engines/vllm_turns.py)."""
        return VllmTurns(pipeline)

    async def compile_block(self, namespace: str, block) -> None:
        """A registered skill's block compiled ahead of use, at background priority (registration, start-up)."""
        name = self.heads.name(namespace, block)
        await self._failover(name, lambda client: self.heads.compile(client, name, list(block.token_ids), block.base,
                                                                     namespace, background=True))

    def holds(self, namespace: str, block) -> bool:
        """vLLM has saved `block` (a request using it compiles nothing)."""
        return self.heads.holds(namespace, block)

    def plan(self, prep: "Prepared") -> tuple[Chain, dict[int, int], list[tuple[str, list[int], int]]]:
        """The request's chain, the seam each skill got, and the blocks it copies (record, ids, base)."""
        return self.heads.chain_for(prep.params.namespace, prep.plan, prep.blocks, prep.seams)

    async def health(self) -> bool:
        """Any replica answers."""
        return await self.pool.health()

    async def start(self, prep: "Prepared", finish) -> AsyncIterator["Delta | Final"]:
        """Build the head inside vLLM (when one is due), then stream from vLLM. `finish(prep, done, pre, ttft_ms)`
        builds the Final (the pipeline's, shared with the embedded engine). Errors before the first token raise.
        In flight from here to the stream's end: background prefills wait meanwhile."""
        self.bg.started()
        try:
            events = await self._start(prep, finish)
        except BaseException:
            self.bg.ended()
            raise
        return self._counted(events)

    async def _counted(self, events) -> AsyncIterator["Delta | Final"]:
        try:
            async for item in events:
                yield item
        finally:
            self.bg.ended()
            await events.aclose()

    def due(self, digest: str) -> bool:
        """The composition has been served composed SKILLCACHE_VLLM_REFINE_AFTER times: its next request refines."""
        return bool(self.refine_after) and self._seen.get(digest, 0) >= self.refine_after

    @staticmethod
    def route(namespace: str, chain: Chain | None, ids: list[int]) -> str:
        """The routing key: the composition's digest, else the tenant and the prompt's first tokens (a session's
        turns, a repeated system prompt: the replica whose prefix cache holds them)."""
        if chain is not None and chain.n_head:
            return chain.digest
        return hashlib.sha256(json.dumps([namespace, ids[:ROUTE_TOKENS]]).encode()).hexdigest()[:32]

    async def _start(self, prep: "Prepared", finish) -> AsyncIterator["Delta | Final"]:
        plan = None
        if prep.mode == "compose" and prep.blocks:
            plan = self.plan(prep)
        route = self.route(prep.params.namespace, plan[0] if plan else None, prep.plan.ids)
        return await self._failover(route, lambda client: self._start_on(client, prep, finish, plan))

    async def _start_on(self, client, prep: "Prepared", finish, planned) -> AsyncIterator["Delta | Final"]:
        from service.runtime.steps import PrefillResult

        plan, ns = prep.plan, prep.params.namespace
        salt, t_head, transfer, n_step = exact_salt(ns), 0.0, None, 0
        after: list = []  # background work once the response is out: never on its clock
        pre = PrefillResult(None, None, plan.n_tokens, 0, plan.n_tokens, {"prefill_ms": 0.0})
        chain, refining = None, None  # refining: the digest whose head this request refines
        if planned is not None:
            chain, seams, blocks = planned
            pre.seams = dict(seams)
            # refined (vLLM's exact prefix) or refining (vLLM prefills the whole prompt): exact, no transfer, under
            # the order's own salt; else composed
            refined = chain.n_head > 0 and self.heads.refined(client, chain.digest)
            if chain.n_head > 0 and not refined and self.due(chain.digest) and self.heads.claim(client, chain.digest):
                refining = chain.digest
            if refined or refining is not None:
                salt = refined_salt(ns, chain.digest)
            elif chain.n_head > 0:
                salt = approx_salt(ns, chain.digest)
                t0 = time.perf_counter()
                await asyncio.gather(*(self.heads.compile(client, name, ids, base, ns) for name, ids, base in blocks))
                n_step = await self.heads.build(client, chain, plan.ids, salt)
                t_head = (time.perf_counter() - t0) * 1e3
                transfer = {"skillcache": chain.final.to_dict()}
        h = chain.n_head if chain is not None else 0
        usage, ids = Usage(), plan.ids
        stream = None
        try:
            if prep.tools is not None and prep.tools.options:
                ids = ids + await self._choose(client, prep.tools, ids, salt, transfer)
                pre.n_prompt = len(ids)
            stream = client.stream(ids, prep.params.gen, salt, transfer, usage)
            first = await anext(stream)
        except BaseException:
            if refining is not None:
                self.heads.settle(client, refining, prefilled=False)
            if stream is not None:
                await stream.aclose()
            raise
        if refining is not None:
            self.heads.settle(client, refining, prefilled=True)
        if transfer is not None and chain is not None:  # served from here on: counted once, on the replica that did
            touch(self._seen, chain.digest, self._seen.get(chain.digest, 0) + 1)
            metrics.VLLM_HEADS.labels("composed").inc()
            if self.guard is not None and prep.params.late is None:  # as on the embedded engine: a memory's is not
                check = self.checks.shadow(client, ns, list(ids), salt, transfer)  # the skills' check
                after.append(lambda: self.guard.maybe_shadow(prep.keys, check))
        ttft_ms = (time.perf_counter() - prep.t_start) * 1e3
        pre.timings_ms["prefill_ms"] = t_head
        records = [p.name for p in chain.final.load] if chain is not None else []
        events = self._events(client, prep, first, stream, usage, pre, ttft_ms, h, n_step, salt.startswith("approx:"),
                              finish, after, records)
        parser = prep.tools.parser() if prep.tools is not None else None
        return parsed(events, parser) if parser is not None else events

    async def _choose(self, client, tools, ids: list[int], salt: str, transfer: dict | None) -> list[int]:
        """tool_choice `required` among several tools: vLLM picks the name (its structured output `choice`, greedy,
        from the prompt that ends just before a name; the head loaded as for the reply), the reply then continues
        after the chosen name and the rest of its opening (the embedded engine scores each whole name instead)."""
        texts = [c.text for c in tools.options]
        picked = await client.choose(ids, texts, salt, transfer, 4 * max(len(c.name_ids) + len(c.rest_ids)
                                                                        for c in tools.options))
        if picked not in texts:  # structured output keeps to the choices: only a vLLM without it gets here
            log.warning("vLLM's choice %r is none of the offered tools; the first is used", picked)
        best = tools.options[texts.index(picked) if picked in texts else 0]
        tools.chosen(best)
        return best.name_ids + best.rest_ids

    async def _events(self, client, prep, first, stream, usage: Usage, pre, ttft_ms: float, h: int, n_step: int,
                      approx: bool, finish, after: list, names: list[str]):
        text, ids, reason, top, chunk = [], [], None, first.top_logprobs, first
        try:
            while True:
                if chunk.text:
                    yield Delta(chunk.text)
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                reason = chunk.finish_reason or reason
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
        finally:
            await stream.aclose()
        cached, n = usage.cached_tokens, pre.n_prompt  # the prompt sent: a chosen tool's opening included
        if approx and cached < h:  # the connector did not load the whole head: vLLM computed it (nothing wrong served)
            metrics.VLLM_HEADS.labels("rejected").inc()
            log.warning("vLLM computed %d of the %d head tokens skillcache planned to load", h - cached, h)
            self.heads.forget(client, names)
        # approximate salt: the head is composed, less what this request's chain steps computed (seams, text between
        # blocks: the first time a composition is served). Beyond the head (h: its length), what vLLM's prefix cache
        # served under the same salt (an earlier turn of a session, a repeated turn) is an automatic head, as on the
        # embedded engine (service/compose/auto.py); so is what it served beyond a refined head under the exact salt,
        # or of a prompt with no head at all
        past_head = max(0, cached - h)
        if approx:
            pre.n_reused = h - n_step if cached >= h else 0
            pre.n_prefix = pre.n_auto = past_head
        else:
            pre.n_reused, pre.n_prefix, pre.n_auto = 0, cached, past_head
        pre.n_recomputed = n - pre.n_reused - pre.n_prefix
        done = Done(reason or "stop", "".join(text), ids, top)
        yield finish(prep, done, pre, ttft_ms)
        for work in after:
            work()

    async def close(self) -> None:
        self.bg.close()
        await self.pool.close()
        if self.shared is not None:
            await self.shared.close()


if TYPE_CHECKING:
    def _is_an_engine(e: VllmEngine) -> Engine:
        return e  # mypy checks VllmEngine against the Engine protocol here
