"""A session turn with blocks placed late: `[system][skills][conversation][MEMORY][user turn]`.

The conversation's K/V stays in the session's cache, append-only: the turn keeps its longest common prefix with the
new prompt (never past the memory: the cache never holds it) and prefills only what follows. The memory's blocks,
precompiled alone after the template's opening (ModelRuntime.compile_block_steps), are re-rotated from their
canonical copies to where they land in this turn, after the first `seam` tokens of each are recomputed against the
real preceding context; the text around them (the user turn's opening, joiners, [MEMORY UPDATE] lines, the user's
own content, the assistant opening) is prefilled on top. After the reply the memory span leaves the cache again
(service.kv.cache.remove_span), so the next turn floats the memory, current as it is then, to its new place.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from service.errors import InternalError
from service.kv.block import KVBlock
from service.kv.cache import append_block, append_kv, block_from_cache, new_cache, truncate
from service.kv.rope import KeyRotator
from service.runtime.steps import PrefillResult, Steps
from service.runtime.prompt import PromptPlan


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def late_turn_steps(rt, cache: DynamicCache, cached_ids: list[int], plan: PromptPlan, blocks: list[KVBlock],
                    seam_tokens: list[int], chunk: int | None = None, rotator: KeyRotator | None = None) -> Steps:
    """Extend `cache` (holding `cached_ids`) to `plan`, whose late span holds `blocks` (in order), in steps ->
    PrefillResult on the same cache: n_prefix the conversation tokens kept, n_reused the block tokens copied.

    `seam_tokens`: per block, its first tokens recomputed in context. Skill segments before the late span (the
    system turn's) are prefilled as text when the cache no longer holds them: a session whose cache was lost
    re-prefills its head in full, as extend_steps does. `rotator`: the no-rotation control of bench/memory.py.
    """
    if plan.late_span is None or len(seam_tokens) != len(blocks):
        raise InternalError("a late turn needs a plan with a late span and one seam per block")
    t0 = time.perf_counter()
    rotator = rotator or rt.rotator
    ids, late_start = plan.ids, plan.late_span[0]
    lcp = min(common_prefix(cached_ids, ids), late_start, cache.get_seq_length(), len(ids) - 1)
    truncate(cache, lcp)
    pending: list[int] = []  # ids waiting to run; they end just before position `pos`
    pos, j, n_reused, seams, t_rotate = 0, 0, 0, {}, 0.0
    for seg in plan.segments:
        seg_start, pos = pos, pos + len(seg.ids)
        if pos <= lcp:
            continue
        if seg.kind == "text" or seg_start < late_start:
            pending.extend(seg.ids[max(0, lcp - seg_start):])
            continue
        block, seam = blocks[j], min(seam_tokens[j], len(seg.ids))
        if block.token_ids != seg.ids:
            raise InternalError("a late block's ids differ from the prompt's")
        pending.extend(seg.ids[:seam])
        if pending:
            yield from rt.forward_steps(pending, seg_start + seam - len(pending), cache, chunk)
            pending = []
        t1 = time.perf_counter()
        n_reused += append_block(cache, block, seam, block.n_tokens, offset=seg_start, rotator=rotator)
        t_rotate += time.perf_counter() - t1
        seams[seg.skill_index] = seam
        j += 1
    if j != len(blocks) or not pending:
        raise InternalError("the late blocks must all be in the plan, with text after the last")
    logits = yield from rt.forward_steps(pending, pos - len(pending), cache, chunk)
    timings = {"prefill_ms": (time.perf_counter() - t0) * 1e3, "rotate_ms": t_rotate * 1e3}
    return PrefillResult(cache, logits, len(ids), n_reused, len(ids) - n_reused - lcp, timings, lcp, seams)


@torch.inference_mode()
def inplace_block_steps(rt, block: KVBlock, new_ids: list[int], start: int, old_end: int, new_end: int,
                        chunk: int | None = None) -> Steps:
    """`block` with its tokens [start, old_end) replaced by new_ids[start:new_end], recomputed in place -> KVBlock of
    new_ids at the same canonical positions (a memory fact's in-place edit, service/memory/edits.py).

    Tokens before the span keep their K/V (exact: they never saw it). The new tokens are run through the model
    after them, as a compile of new_ids would. Tokens after the span keep their K/V too, moved by the change in
    length (keys re-rotated): they are stale, computed while reading the old value. That is what an in-place edit
    is (the paper, arXiv 2606.17107, on errata: it barely moves a decision that later tokens had already taken
    notes on).
    """
    if new_ids[:start] != block.token_ids[:start] or new_ids[new_end:] != block.token_ids[old_end:]:
        raise InternalError("an in-place edit must keep the block's ids outside the edited span")
    if block.base not in (0, len(rt.anchor)):
        raise InternalError("the block was compiled after another anchor")
    cache = new_cache(rt.model.config, reserve_tokens=block.base + len(new_ids))
    if block.base:
        rt.append_anchor(cache)  # L x [1, H_kv, A, D], the opening every block is compiled after
    append_kv(cache, [k[:, :, :start] for k in block.keys], [v[:, :, :start] for v in block.values])
    yield from rt.forward_steps(new_ids[start:new_end], block.base + start, cache, chunk)
    rest_k, rest_v = rt.rotator.move_layers([k[:, :, old_end:] for k in block.keys],  # L x [1, H_kv, N - e, D]
                                            [v[:, :, old_end:] for v in block.values], new_end - old_end)
    append_kv(cache, rest_k, rest_v)
    out = block_from_cache(cache, new_ids, rt.fingerprint, base=block.base)
    out.meta["dtype"] = str(out.dtype).removeprefix("torch.")
    return out
