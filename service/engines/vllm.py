"""VllmEngine: a prepared request runs on a vLLM server; skillcache composes its head and relays the stream.

compose, an order not yet refined: the head (every prompt token up to the last block's end: the anchor, the blocks
re-rotated, their seams and the text between them recomputed here on the same weights) is published to the head
pool (service/vllm/heads.py) once per distinct composition and named in the request; vLLM's connector loads it and
vLLM computes only the text after it. The salt `approx:<namespace>:<digest of the composition>` keeps those
approximate K/V in vLLM's prefix cache for the same composition only: a repeat of it hits there (and reloads at
most the head's last partial block from the pool), and no exact request, no other tenant and no other composition
ever reads them.
Refinement: once a composition has been served SKILLCACHE_REFINE_AFTER times, vLLM prefills its head exactly in the
background (one request of the head's ids under `exact:<namespace>`, one token generated); when that is done the
order goes out under the exact salt with no head, and vLLM's own prefix cache serves the exact head (no second copy
of it here). mode=full: the exact salt, no head. Automatic reuse is vLLM's own prefix cache under the exact salt: what
it serves past a refined head (or of a prompt with no head) is reported as `auto_tokens`, as on the embedded engine.
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
from service.runtime.params import Delta, Done
from service.tools.events import parsed
from service.vllm.client import Usage, VllmClient
from service.vllm.heads import HeadWriter, Layout

if TYPE_CHECKING:
    from service.compose.pipeline import Final, Prepared

log = logging.getLogger(__name__)
HEAD_TAIL = 1 << 30  # prefill_steps(tail_limit=): the whole text after the last block is vLLM's


def exact_salt(namespace: str) -> str:
    return f"exact:{namespace}"


def approx_salt(namespace: str, digest: str) -> str:
    return f"approx:{namespace}:{digest}"


def head_digest(fingerprint: str, namespace: str, plan, head_n: int, seams: list[int]) -> str:
    """What fixes a composed head's K/V: the model, the ids, which spans are blocks, their seams and edited spans."""
    segs, pos = [], 0
    for s in plan.segments:  # the head's own segments (the text after it, the user turn, is not part of it)
        if pos >= head_n:
            break
        segs.append((s.kind, min(len(s.ids), head_n - pos), sorted(map(list, getattr(s, "recompute", []) or []))))
        pos += len(s.ids)
    raw = json.dumps([fingerprint, namespace, plan.ids[:head_n], segs, seams]).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def head_length(plan) -> int:
    """Tokens up to the end of the last skill block (the text after it is computed by vLLM)."""
    pos = end = 0
    for seg in plan.segments:
        pos += len(seg.ids)
        if seg.kind == "skill":
            end = pos
    return end


class VllmEngine:
    keeps_conversations = True  # sessions send the whole conversation: vLLM's prefix cache holds it (sessions/)
    # system-prompt sections stay text: a composed head is approximate and travels under a request-only salt, so it
    # would take a repeated system prompt away from vLLM's exact prefix cache, which serves it already
    composes_sections = False

    def __init__(self, settings, runtime, serving_engine, client: VllmClient | None = None) -> None:
        self.settings = settings
        self.rt = runtime
        self.serving = serving_engine  # the model thread: heads are composed there
        self.client = client or VllmClient(settings.vllm_url, settings.vllm_model, settings.vllm_timeout_s)
        self.layout = self._layout()
        self.pool = HeadWriter(settings.vllm_heads_dir, settings.vllm_head_pool_bytes, runtime.fingerprint, self.layout)
        self.refine_after = settings.refine_after
        self._seen: OrderedDict[str, int] = OrderedDict()  # head digest -> compositions served (LRU, bounded)
        self._seams: dict[str, dict[int, int]] = {}  # head digest -> the seams its composition recomputed
        self._exact: OrderedDict[str, None] = OrderedDict()  # digests whose exact head vLLM has prefilled
        self._refining: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def _layout(self) -> Layout:
        c = self.rt.config
        dtype = self.settings.vllm_dtype  # vLLM's cache dtype: the head is cast to it once, here
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return Layout(c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                      head_dim, dtype)

    def _count(self, digest: str) -> int:
        n = self._seen.pop(digest, 0)
        self._seen[digest] = n + 1
        while len(self._seen) > 4096:
            self._seams.pop(self._seen.popitem(last=False)[0], None)
        return n + 1

    def _refine(self, digest: str, head_ids: list[int], namespace: str) -> None:
        """vLLM prefills the exact head in the background; the order switches to it when that is done."""
        if digest in self._refining:
            return
        self._refining.add(digest)

        async def run() -> None:
            try:
                await self.client.prefill(head_ids, exact_salt(namespace))
                self._exact[digest] = None
                while len(self._exact) > 4096:
                    self._exact.popitem(last=False)
                metrics.VLLM_HEADS.labels("refined").inc()
            except Exception as e:  # noqa: BLE001 - a background refinement that fails leaves the order composed
                log.warning("refinement of a head on vLLM failed: %s", e)
            finally:
                self._refining.discard(digest)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def health(self) -> bool:
        return await self.client.health()

    async def start(self, prep: "Prepared", finish) -> AsyncIterator["Delta | Final"]:
        """Compose the head (when one is due), then stream from vLLM. `finish(prep, done, pre, ttft_ms)` builds the
        Final (the pipeline's, shared with the embedded engine). Errors before the first token raise here."""
        from service.runtime.engine import PrefillResult

        plan, ns = prep.plan, prep.params.namespace
        h = head_length(plan) if prep.mode == "compose" else 0
        ref, salt, t_head, n_reused = None, exact_salt(ns), 0.0, 0  # n_reused: head tokens published
        refine = None
        pre = PrefillResult(None, None, plan.n_tokens, 0, plan.n_tokens, {"prefill_ms": 0.0})
        if h:
            digest = head_digest(self.rt.fingerprint, ns, plan, h, prep.seams)
            # else refined: vLLM's exact prefix, computed by it once (no head, exact salt)
            if digest not in self._exact:
                salt = approx_salt(ns, digest)
                ref = self.pool.lookup(digest)
                if ref is not None and not self.pool.acquire(ref):
                    ref = None
                t0 = time.perf_counter()
                if ref is None:
                    composed = await self.serving.run_steps(self.rt.prefill_steps(
                        plan, prep.blocks, mode="compose", seam_tokens=prep.seams,
                        chunk=self.settings.prefill_chunk_tokens, defer_tail=True, tail_limit=HEAD_TAIL))
                    layers = composed.cache.layers
                    t1 = time.perf_counter()
                    ref = self.pool.publish(plan.ids[:h], [la.keys for la in layers], [la.values for la in layers],
                                            digest)
                    pre.n_reused, pre.seams = composed.n_reused, composed.seams
                    self._seams[digest] = composed.seams
                    log.debug("head of %d tokens: composed in %.0f ms, published in %.0f ms", h, (t1 - t0) * 1e3,
                              (time.perf_counter() - t1) * 1e3)
                    metrics.VLLM_HEADS.labels("composed" if ref is not None else "no_room").inc()
                else:
                    pre.seams = dict(self._seams.get(digest, {}))
                    metrics.VLLM_HEADS.labels("reused").inc()
                t_head = (time.perf_counter() - t0) * 1e3
                n_reused = h if ref is not None else 0
                n_seen = self._count(digest)
                if self.refine_after and n_seen >= self.refine_after:  # after the response, below
                    refine = lambda: self._refine(digest, plan.ids[:h], ns)  # noqa: E731
        transfer = {"skillcache": ref.to_dict()} if ref is not None else None
        usage, ids = Usage(), plan.ids
        stream = None
        try:
            if prep.tools is not None and prep.tools.options:
                ids = ids + await self._choose(prep.tools, ids, salt, transfer)
                pre.n_prompt = len(ids)
            stream = self.client.stream(ids, prep.params.gen, salt, transfer, usage)
            first = await anext(stream)
        except BaseException:
            if ref is not None:
                self.pool.release(ref)
            if stream is not None:
                await stream.aclose()
            raise
        ttft_ms = (time.perf_counter() - prep.t_start) * 1e3
        if ref is not None:
            self.pool.release(ref)  # loaded: vLLM had it before its first token
        pre.timings_ms["prefill_ms"] = t_head
        events = self._events(prep, first, stream, usage, pre, ttft_ms, h, n_reused, salt != exact_salt(ns), finish,
                              refine)
        parser = prep.tools.parser() if prep.tools is not None else None
        return parsed(events, parser) if parser is not None else events

    async def _choose(self, tools, ids: list[int], salt: str, transfer: dict | None) -> list[int]:
        """tool_choice `required` among several tools: vLLM picks the name (its structured output `choice`, greedy,
        from the prompt that ends just before a name; the head loaded as for the reply), the reply then continues
        after the chosen name and the rest of its opening (the embedded engine scores each whole name instead)."""
        texts = [c.text for c in tools.options]
        picked = await self.client.choose(ids, texts, salt, transfer, 4 * max(len(c.name_ids) + len(c.rest_ids)
                                                                             for c in tools.options))
        if picked not in texts:  # structured output keeps to the choices: only a vLLM without it gets here
            log.warning("vLLM's choice %r is none of the offered tools; the first is used", picked)
        best = tools.options[texts.index(picked) if picked in texts else 0]
        tools.chosen(best)
        return best.name_ids + best.rest_ids

    async def _events(self, prep, first, stream, usage: Usage, pre, ttft_ms: float, h: int, n_reused: int,
                      approx: bool, finish, refine):
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
        if n_reused and cached < h:  # the connector did not load the head: vLLM computed it (nothing wrong served)
            metrics.VLLM_HEADS.labels("rejected").inc()
            log.warning("vLLM computed %d of the %d head tokens skillcache published", h - cached, h)
        # what vLLM did not compute came from the head it loaded or its prefix cache: composed K/V under an approximate
        # salt, exact K/V under the exact one. Exact beyond a refined head (h: its length), or with no head at all (no
        # skills, mode=full): vLLM's prefix cache served a repeated prompt head, salted per tenant, as the embedded
        # engine's automatic heads do (service/compose/auto.py): usage and metrics say auto for it
        pre.n_reused, pre.n_prefix = (cached, 0) if approx else (0, cached)
        pre.n_auto = 0 if approx else max(0, cached - h)
        pre.n_recomputed = n - cached
        done = Done(reason or "stop", "".join(text), ids, top)
        yield finish(prep, done, pre, ttft_ms)
        if refine is not None:  # after the response: never on the sampled request's clock
            refine()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.pool.close()
        await self.client.close()
