"""The vLLM engine's fidelity checks, as vLLM requests: seam calibration and shadow checks compare a composed prompt's
first-token top-k logprobs with vLLM's full prefill of the same ids (service/vllm/fidelity.py). vLLM computes both;
every prefill goes at background priority, in chunks, while no live request is in flight (service/vllm/background.py).

The FidelityGuard (service/compose/guard.py) decides when a check runs and what its result changes, as on the
embedded engine (service/engines/embedded_checks.py): a failed shadow check serves the skill by full prefill, a
calibration sets the seam its compositions get.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from service.errors import ServiceError
from service.kv.blockref import BlockRef
from service.runtime.params import GenParams
from service.vllm.background import approx_salt, check_salt
from service.vllm.client import Usage
from service.vllm.fidelity import TOP_K, top_agreement

if TYPE_CHECKING:
    from service.vllm.background import Background
    from service.vllm.heads import VllmHeads

log = logging.getLogger(__name__)

# probe contexts (as the embedded calibration's, service/runtime/calibrate.py): the block first, after the template's
# opening (exact at any seam), and second, after a neighbour that is computed whole: only this block's seam varies
PROBES = [
    ("You are a helpful assistant.", None, "What should I do first?"),
    ("You are a support agent for a large online store. Answer precisely, cite the rule you apply, and keep "
     "the reply short.", "Context: the customer has contacted us twice this week about the same order.",
     "Summarise the most important rule above."),
]


@dataclass
class TopCalibration:
    seam: int
    passed: bool  # False: no candidate met the rule; `seam` is the whole block
    top1_agree: float  # over decisive probes, at `seam`
    tv_max: float  # the largest top-k distance over the probes, at `seam`
    n_probes: int
    elapsed_ms: float
    basis: str = f"vLLM top-{TOP_K} logprobs"

    def to_dict(self) -> dict:
        return asdict(self)


class VllmChecks:
    def __init__(self, settings, runtime, heads: "VllmHeads", background: "Background") -> None:
        self.s = settings
        self.rt = runtime  # its prompt builder and anchor: the probes' prompts
        self.heads = heads  # builds composed heads inside vLLM (and knows the replicas)
        self.bg = background

    async def _top(self, client, ids: list[int], salt: str, transfer: dict | None) -> list[tuple[str, float]]:
        """The first generated position's top-k after `ids` (one token, greedy)."""
        stream = client.stream(ids, GenParams(max_tokens=1, temperature=0.0, logprobs=TOP_K), salt, transfer, Usage())
        try:
            async for chunk in stream:
                if chunk.top_logprobs:
                    return chunk.top_logprobs
        finally:
            await stream.aclose()
        return []

    async def _full(self, client, namespace: str, ids: list[int]) -> list[tuple[str, float]]:
        """vLLM's full prefill of `ids` (under the checks' own salt), prefilled behind live traffic first."""
        await self.bg.prefill(client, ids[:-1], check_salt(namespace))
        return await self._top(client, ids, check_salt(namespace), None)

    async def _composed(self, client, namespace: str, plan, blocks, seams: list[int]) -> list[tuple[str, float]]:
        """`plan` composed from `blocks` with `seams`, built inside vLLM at background priority."""
        heads = self.heads
        chain, _, used = heads.chain_for(namespace, plan, blocks, seams)
        salt = approx_salt(namespace, chain.digest)
        for name, ids, base in used:
            await heads.compile(client, name, ids, base, namespace, background=True)
        await heads.build(client, chain, plan.ids, salt, background=True)
        transfer = {"skillcache": chain.final.to_dict()} if chain.n_head else None
        return await self._top(client, plan.ids, salt, transfer)

    async def calibrate(self, key, block) -> TopCalibration | None:
        """The smallest candidate seam whose composition keeps the full prefill's top-1 on every decisive probe
        (none: the whole block). None when vLLM could not be reached (a later request schedules it again)."""
        ns, rt, t0 = key.namespace, self.rt, time.perf_counter()
        cases = []
        try:
            client = self.heads.pool.order(str(key))[0]
            for system, neighbour_text, user in PROBES:
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
                blocks: list = [block]
                lead: list[int] = []  # the seams before the block's: a neighbour computed whole
                if neighbour_text:
                    n_ids = rt.prompts.encode_content(neighbour_text)
                    blocks = [BlockRef(n_ids, len(rt.anchor)), block]
                    lead = [len(n_ids)]
                plan = rt.prompts.build(msgs, [b.token_ids for b in blocks])
                cases.append((plan, blocks, lead, await self._full(client, ns, plan.ids)))
            best = None
            n = len(block.token_ids)
            for k in sorted({c for c in self.s.seam_candidates if c < n}) + [n]:
                fids = [top_agreement(await self._composed(client, ns, plan, blocks, lead + [k]), full,
                                      self.s.fidelity_tie_margin) for plan, blocks, lead, full in cases]
                decisive = [f for f in fids if f["decisive"]]
                top1 = sum(f["top1_agree"] for f in decisive) / len(decisive) if decisive else 1.0
                best = (k, all(f["ok"] for f in fids), top1, max(f["tv"] for f in fids))
                if best[1]:
                    break
        except ServiceError as e:
            log.warning("seam calibration on vLLM not run (%s); a later request schedules it again", e)
            return None
        assert best is not None
        return TopCalibration(best[0], best[1], best[2], best[3], len(cases), (time.perf_counter() - t0) * 1e3)

    def shadow(self, client, namespace: str, ids: list[int], salt: str, transfer: dict | None) -> Callable:
        """The shadow check of one composed request: its first-token top-k again (vLLM's prefix cache holds the head
        under its salt) against vLLM's full prefill of the same ids."""

        async def check(started: Callable[[], None]) -> dict | None:
            started()
            try:
                await self.bg.idle()
                composed = await self._top(client, ids, salt, transfer)
                full = await self._full(client, namespace, ids)
                return top_agreement(composed, full, self.s.fidelity_tie_margin)
            except (ServiceError, ValueError) as e:
                log.warning("shadow check on vLLM not run: %s", e)
                return None

        return check
