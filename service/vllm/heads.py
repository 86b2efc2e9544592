"""What vLLM has saved for skillcache and how a composed head gets built there: blocks compiled once by vLLM (a
prefill of the block in its canonical context, saved by the connector), a composition's chain of steps (the tokens
computed between copies), refined heads (vLLM's exact prefill of a head, in its own prefix cache).

Keys: a record's name when the replicas share their records (SKILLCACHE_VLLM_SHARED_SPANS), else the replica's URL
and the name; a refined head is always per replica (vLLM's prefix cache is its own)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from service import metrics
from service.kv.plan import plan_ops
from service.vllm.background import LIVE, Background
from service.vllm.chain import Chain, block_name, chain_digest, head_of
from service.vllm.transfer import Save, Transfer

KNOWN = 4096  # compositions and saved blocks remembered (LRU)


def touch(lru: OrderedDict, key: str, value=None) -> None:
    lru.pop(key, None)
    lru[key] = value
    while len(lru) > KNOWN:
        lru.popitem(last=False)


class VllmHeads:
    def __init__(self, rt, pool, shared, background: Background) -> None:
        self.rt = rt  # its tokenizer's anchor and fingerprint name the records
        self.pool = pool
        self.shared = shared  # the shared spans tier's index (None: each replica's spans dir alone)
        self.bg = background
        self._chains: OrderedDict[str, None] = OrderedDict()  # compositions whose steps vLLM has run and saved
        self._blocks: OrderedDict[str, None] = OrderedDict()  # block records vLLM has saved
        self._compiling: dict[str, asyncio.Future] = {}
        self.exact: OrderedDict[str, None] = OrderedDict()  # (replica, digest) whose exact head vLLM has prefilled
        self._refining: set[str] = set()

    def _key(self, client, name: str) -> str:
        return name if self.shared is not None else f"{self.pool.name(client)}|{name}"

    def name(self, namespace: str, block) -> str:
        return block_name(namespace, self.rt.fingerprint, list(self.rt.anchor[:block.base]), list(block.token_ids))

    def holds(self, namespace: str, block) -> bool:
        """vLLM has saved this block (as far as this process knows; on some replica, without a shared tier): a
        request that uses it compiles nothing."""
        name = self.name(namespace, block)
        return any(self._key(c, name) in self._blocks for c in self.pool.clients)

    def chain_for(self, ns: str, plan, blocks, seams: list[int]
                  ) -> tuple[Chain, dict[int, int], list[tuple[str, list[int], int]]]:
        """`plan` composed from `blocks` (BlockRefs) with `seams`: its chain, the seam each block got, the blocks it
        copies (record, ids, base). The plan is the embedded engine's (service/kv/plan.py)."""
        composed = plan_ops(plan.segments, [b.base for b in blocks], seams, list(self.rt.anchor))
        ops = head_of(composed)
        names = [self.name(ns, b) for b in blocks]
        chain = Chain.build(ops, names, chain_digest(ns, self.rt.fingerprint, plan.ids, ops, names))
        used = sorted({op.block for op in ops if op.kind == "copy" and op.block is not None})
        return chain, composed.seams, [(names[i], list(blocks[i].token_ids), blocks[i].base) for i in used]

    async def compile(self, client, name: str, ids: list[int], base: int, namespace: str,
                      background: bool = False) -> None:
        """vLLM prefills the block in its canonical context (the anchor's first `base` tokens, then the block) and
        the connector saves it; once per record (single flight), and not at all when the shared tier holds it."""
        key = self._key(client, name)
        if key in self._blocks:
            return
        fut = self._compiling.get(key)
        if fut is not None:
            await fut
            return
        fut = asyncio.get_running_loop().create_future()
        self._compiling[key] = fut
        try:
            if self.shared is not None and await self.shared.has(name):
                metrics.VLLM_HEADS.labels("shared").inc()
            else:
                t0 = time.perf_counter()
                prompt = list(self.rt.anchor[:base]) + list(ids)
                save, salt = Save(name, 0, len(prompt)), f"compile:{namespace}"
                metrics.VLLM_COMPILES.labels(self.pool.name(client)).inc()
                if background:
                    await self.bg.prefill(client, prompt, salt, save)
                else:
                    await client.prefill(prompt, salt, Transfer(save=save), LIVE)
                metrics.VLLM_HEADS.labels("compiled").inc()
                metrics.STAGE.labels("compile").observe(time.perf_counter() - t0)
            touch(self._blocks, key)
            fut.set_result(None)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: a compile nobody else awaited logs nothing
            raise
        finally:
            self._compiling.pop(key, None)

    async def build(self, client, chain: Chain, ids: list[int], salt: str, background: bool = False) -> int:
        """Run the chain's steps (each computes and saves one run of tokens between copies) unless a repeat of the
        composition finds them saved; the tokens they computed. background: each step at background priority, sent
        while no live request is in flight (checks)."""
        key = self._key(client, chain.digest)
        if key in self._chains:
            return 0
        for n, transfer in chain.steps:
            if background:
                await self.bg.idle()
            await client.prefill(ids[:n], salt, transfer, self.bg.priority(background))
        touch(self._chains, key)
        return chain.n_head - chain.n_copied

    def forget(self, client, records: list[str]) -> None:
        """Records the connector could not load (gone from the spans dir, corrupt and removed): compiled or computed
        anew the next time a request needs them (a block the shared index still names is not compiled: the
        connector takes a record Redis lost out of the index when it misses it)."""
        for name in records:
            self._blocks.pop(self._key(client, name), None)
            if name.startswith("step-"):
                self._chains.pop(self._key(client, name.split("-")[1]), None)

    def refined(self, client, digest: str) -> bool:
        """vLLM on this replica has prefilled the composition's exact head: it goes out exact, nothing loaded."""
        return f"{self.pool.name(client)}|{digest}" in self.exact

    def claim(self, client, digest: str) -> bool:
        """This request refines the composition's head on its replica: it goes out exact and vLLM prefills the whole
        prompt, as vLLM alone would (one claim in flight per replica and head; the others stay composed meanwhile)."""
        key = f"{self.pool.name(client)}|{digest}"
        if key in self._refining:
            return False
        self._refining.add(key)
        return True

    def settle(self, client, digest: str, prefilled: bool) -> None:
        """The claiming request's prefill is done (its first token came: vLLM's prefix cache holds the exact head
        under the exact salt) or failed (the order stays composed; a later request claims it again)."""
        key = f"{self.pool.name(client)}|{digest}"
        self._refining.discard(key)
        if prefilled:
            touch(self.exact, key)
            metrics.VLLM_HEADS.labels("refined").inc()
