"""Composer: what a composed prompt's cache is made of: which tokens are copied from a block (re-rotated to their
place), which run through the model (seams, edited spans, the text between blocks), and where an exact prefix ends.

The runtime (service/runtime/model.py) owns the model and its forwards; the Composer drives them for one prompt. Both
engines use it: the embedded engine for the whole prompt, the vLLM engine for the head it publishes (tail_limit).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from service.errors import InternalError
from service.kv.block import KVBlock
from service.kv.cache import append_block, append_kv, new_cache
from service.kv.radix import HeadMatch
from service.kv.plan import plan_ops
from service.runtime.prompt import PromptPlan, Segment
from service.runtime.steps import DEFERRED_TAIL_TOKENS, Mode, PrefillResult, Steps


class Forwards(Protocol):
    """What the Composer drives: the model runtime (service/runtime/model.py, ModelRuntime)."""

    anchor: list[int]
    model: Any
    rotator: Any  # re-rotates a copied block's keys to their new positions (service/runtime/adapters.py)

    def forward_steps(self, ids: list[int], start: int, cache: DynamicCache, chunk: int | None = None) -> Steps: ...

    def append_anchor(self, cache: DynamicCache) -> None: ...


def _inside(i: int, spans: list[tuple[int, int]]) -> bool:
    return any(s <= i < e for s, e in spans)


class Composer:
    def __init__(self, rt: Forwards) -> None:
        self.rt = rt

    def _skip_prefix(self, plan: PromptPlan, prefix: "KVBlock | HeadMatch", cache: DynamicCache) -> list[Segment]:
        """Copy an exact prefix (plan.ids[:N]: it ends at a segment boundary or inside a text segment, before the
        prompt's end) into the empty cache; return the segments after it (a text segment cut at N keeps its rest)."""
        n = prefix.n_tokens
        if plan.ids[:n] != prefix.token_ids or n >= plan.n_tokens:
            raise InternalError("the prefix's ids differ from the prompt's, or leave nothing to run")
        start = 0
        for i, seg in enumerate(plan.segments):
            end = start + len(seg.ids)
            if end > n:
                if start < n and seg.kind != "text":
                    raise InternalError("a prefix may not end inside a skill block")
                rest = [Segment("text", seg.ids[n - start:])] if start < n else [seg]
                break
            start = end
        if isinstance(prefix, HeadMatch):
            prefix.append_to(cache)  # spans of L x [1, H_kv, t, D], copied out of the head tree
        else:
            append_kv(cache, prefix.keys, prefix.values)  # L x [1, H_kv, N, D], copied
        return rest + plan.segments[i + 1:]

    @staticmethod
    def _check_ids(segments: list[Segment], blocks: list[KVBlock], seams: dict[int, int]) -> None:
        """Each skill's block spells the prompt's ids, outside the spans it computes (its seam, edited spans)."""
        for seg in segments:
            if seg.kind != "skill":
                continue
            block = blocks[seg.skill_index]
            if len(block.token_ids) != len(seg.ids):
                raise InternalError("block ids differ from the prompt's skill ids")
            spans = [(0, seams[seg.skill_index]), *seg.recompute]
            if any(a != b and not _inside(i, spans) for i, (a, b) in enumerate(zip(block.token_ids, seg.ids))):
                raise InternalError("block ids differ from the prompt's skill ids outside edited spans")

    @torch.inference_mode()
    def steps(
        self, plan: PromptPlan, blocks: list[KVBlock], mode: Mode = "compose", seam_tokens: int | list[int] = 4,
        prefix: "KVBlock | HeadMatch | None" = None, chunk: int | None = None, reserve_tokens: int = 0,
        defer_tail: bool = False, tail_limit: int = DEFERRED_TAIL_TOKENS,
    ) -> Steps:
        """Build the request's cache for `plan` and return the next-token logits (a PrefillResult), in steps: each
        forward of at most `chunk` tokens (None: each text run in one) is a step; block copies happen in between.

        compose: text segments and the first `seam_tokens` (one int, or one per skill) of each block run through the
        model
        against the real preceding context; the rest of each block is re-rotated from its
        canonical copy. full: the token-identical full recompute of plan.ids.
        A first skill right after the anchor it was compiled after is copied as is, with no seam: it is
        already exactly what a full prefill computes, and the anchor's own K/V is cached.
        `prefix` (compose only): the exact K/V of plan.ids[:N] (a refined skill sequence,
        service/compose/refine.py, or an automatic head, service/compose/auto.py; a prompt with no skills too),
        copied as is; composition starts after it. The result's n_exact: where the first token copied re-rotated
        from a block starts (the prefix, a first skill copied as is after the anchor, seams and text before it are
        exact). `reserve_tokens`: the length the cache will reach (prompt and
        decode), so its buffers are allocated once. `defer_tail` (compose): a last text run of at most
        `tail_limit` (default DEFERRED_TAIL_TOKENS) is not run: the result's `tail` holds it and `logits` is None (the
        serving engine runs the tails of requests that compose in the same step as one forward,
        service/kv/batch_tail.py;
        the vLLM engine leaves the whole tail to vLLM).
        """
        t0 = time.perf_counter()
        cache = new_cache(self.rt.model.config, reserve_tokens=max(reserve_tokens, plan.n_tokens))
        if mode == "full" or (prefix is None and not any(s.kind == "skill" for s in plan.segments)):
            logits = yield from self.rt.forward_steps(plan.ids, 0, cache, chunk)
            ms = (time.perf_counter() - t0) * 1e3
            return PrefillResult(cache, logits, plan.n_tokens, 0, plan.n_tokens, {"prefill_ms": ms},
                                 n_exact=plan.n_tokens)
        pending: list[int] = []  # ids waiting to run; they end at position `pos`
        pos = n_reused = n_prefix = 0
        t_rotate = t_text = 0.0
        segments = plan.segments
        if prefix is not None:
            segments = self._skip_prefix(plan, prefix, cache)
            pos = n_prefix = prefix.n_tokens
        ops = plan_ops(segments, [b.base for b in blocks], seam_tokens, self.rt.anchor, start=pos)
        self._check_ids(segments, blocks, ops.seams)

        def flush():
            nonlocal pending, t_text
            if pending:
                t1 = time.perf_counter()
                yield from self.rt.forward_steps(pending, pos - len(pending), cache, chunk)
                t_text += time.perf_counter() - t1
                pending = []

        for op in ops.ops:
            if op.kind == "compute":
                pending.extend(plan.ids[op.at:op.end])
                pos = op.end
                continue
            yield from flush()
            block = blocks[op.block]
            lo = op.src - block.base  # the copy's first index in the block; below 0: the anchor it was compiled after
            t1 = time.perf_counter()
            if lo < 0:
                self.rt.append_anchor(cache)  # op.at == 0, op.n == the anchor's length
            else:
                n_reused += append_block(cache, block, lo, lo + op.n, offset=op.at - lo, rotator=self.rt.rotator)
            t_rotate += time.perf_counter() - t1
            pos = op.end
        if not pending:
            raise InternalError("the prompt must end with text after the last skill")
        deferred = defer_tail and len(pending) <= tail_limit
        t1 = time.perf_counter()
        logits = None if deferred else (yield from self.rt.forward_steps(pending, pos - len(pending), cache, chunk))
        t_tail = time.perf_counter() - t1
        total_ms = (time.perf_counter() - t0) * 1e3
        timings = {"prefill_ms": total_ms, "rotate_ms": t_rotate * 1e3, "text_ms": t_text * 1e3,
                   "tail_ms": t_tail * 1e3}
        return PrefillResult(cache, logits, plan.n_tokens, n_reused, plan.n_tokens - n_reused - n_prefix, timings,
                             n_prefix, ops.seams, pending if deferred else None, pos - len(pending),
                             plan.n_tokens if ops.n_exact is None else ops.n_exact)
