"""What the connector's scheduler side tells its worker side each step (SkillcacheMeta), and how it is planned from
vLLM's scheduler output: slots per KV cache group (vLLM's hybrid KV cache manager gives sliding-window layers groups of
their own that keep only their window), loads, and saves read in parts as vLLM computes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from service.vllm.transfer import Piece, Transfer

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

NULL = -1  # a token's slot in a KV cache group that keeps no block for it (vLLM's null block: out of a sliding window)


@dataclass
class Load:
    pieces: list[Piece]  # clipped to the tokens this request loads
    slots: list[list[int]]  # per KV cache group: one per token, in the pieces' order (NULL: nothing to write there)
    block_ids: list[int]  # the request's blocks those tokens sit in (reported on a failed load)


@dataclass
class SaveJob:
    """One part of a span to save: the tokens [at, at + len(slots[g])) that are in the cache this step (read in the
    step vLLM computes them: a sliding window's group frees its blocks behind it); the record is written after the
    last part. A group's NULL slots (a prefix-cache hit longer than its window: only the first part has them, at its
    start) are saved as zeros, and the record says from which position each layer holds its K/V."""

    name: str
    lo: int
    ids: list[int]  # the whole span's
    at: int
    slots: list[list[int]]  # per KV cache group
    last: bool


@dataclass
class SkillcacheMeta(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class Pending:
    """A request's save, on the scheduler side, until the step that completes its span."""

    name: str
    lo: int
    hi: int
    ids: list[int]
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group
    at: int = -1  # tokens [lo, at) read in earlier steps (-1: none yet)


def transfer_of(request: "Request") -> Transfer | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    d = params.get("skillcache") if isinstance(params, dict) else None
    return Transfer.from_dict(d) if d else None


def slots_of(blocks: list[list[int]], lo: int, hi: int, bs: int) -> list[list[int]]:
    """Slots of tokens [lo, hi) in each KV cache group's blocks (NULL where the group keeps no block: vLLM's null block
    0, a sliding window's tokens behind it)."""
    return [[b[i // bs] * bs + i % bs if b[i // bs] != 0 else NULL for i in range(lo, hi)] for b in blocks]


def plan_step(scheduler_output: "SchedulerOutput", to_load: dict, saves: "dict[str, Pending]", bs: int
              ) -> SkillcacheMeta:
    """What the worker does this step: the loads of requests whose blocks this step allocates (popped from
    `to_load`: request id -> (transfer, start, end)) and the parts of pending saves now in the cache (`saves`:
    request id -> Pending, dropped once done)."""
    meta = SkillcacheMeta()
    blocks_of: dict[str, list[list[int]]] = {}  # the request's whole block lists, per group, where this step tells
    computed: dict[str, int] = {}  # tokens computed after this step
    sched = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
    for r in scheduler_output.scheduled_new_reqs:
        blocks_of[r.req_id] = [list(g) for g in r.block_ids]
        computed[r.req_id] = getattr(r, "num_computed_tokens", 0) + sched.get(r.req_id, 0)
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids and new is not None:  # resumed: new_block_ids holds all its blocks
            blocks_of[req_id] = [list(g) for g in new]
        elif req_id in saves and new is not None:
            for have, more in zip(saves[req_id].blocks, new):
                have.extend(more)
        computed[req_id] = cached.num_computed_tokens[i] + sched.get(req_id, 0)
    for req_id in [r for r in to_load if r in blocks_of]:
        t, start, end = to_load.pop(req_id)
        blocks = blocks_of[req_id]
        touched = list(dict.fromkeys(b for g in blocks for b in g[start // bs:-(-end // bs)] if b != 0))
        meta.loads.append(Load(t.clip(start, end), slots_of(blocks, start, end, bs), touched))
    for req_id, pending in list(saves.items()):
        if req_id in blocks_of:
            pending.blocks = blocks_of[req_id]
        if req_id not in computed or not pending.blocks:
            continue
        at = max(pending.at, pending.lo)
        upto = min(computed[req_id], pending.hi)  # the span's tokens in the cache once this step has run
        if upto <= at:
            continue
        slots = slots_of(pending.blocks, at, upto, bs)  # NULL: a sliding window freed them (a long prefix hit)
        pending.at = upto
        meta.saves.append(SaveJob(pending.name, pending.lo, pending.ids, at, slots, upto >= pending.hi))
        if upto >= pending.hi:
            del saves[req_id]
    return meta
