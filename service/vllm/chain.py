"""A composed head as vLLM runs it: which tokens are copied from saved blocks, which vLLM computes, in what steps.

The same composition the embedded engine's Composer builds (service/runtime/composer.py): a first skill right after
the anchor it was compiled after is copied as is (the anchor with it); every other block is copied re-rotated to its
offset except its first `seam` tokens and its edited spans, which are computed against what precedes them, as is
the text between blocks. The head ends with the last copied token; vLLM computes the rest of the prompt.

vLLM's connector is prefix-only (tokens [0, n) loaded, the rest computed), so computed tokens *between* copies take a
chain of vLLM steps: step j is a request for the prompt up to the end of the j-th computed run, loading everything
before that run (copies, and the runs earlier steps computed and saved) and saving the run it computes. The final
request loads the whole head. A composition's steps are named by its digest: a repeat finds them saved and runs none.

Plain data (no torch, no vllm): service/engines/vllm.py drives it, service/vllm/transfer.py carries it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from service.kv.spans import merge_spans as _merge
from service.vllm.transfer import Piece, Save, Transfer


@dataclass(frozen=True)
class Op:
    kind: str  # "copy" | "compute"
    at: int  # first prompt position
    n: int
    block: int | None = None  # copy: the block's index in the request's blocks
    src: int = 0  # copy: the canonical position of its first token in the block's record

    @property
    def end(self) -> int:
        return self.at + self.n


def head_ops(segments, bases: list[int], seams: list[int], anchor: list[int]) -> list[Op]:
    """The head's ops in prompt order, up to the last copied token (none: nothing to copy, vLLM computes it all).
    segments: the plan's (kind, ids, skill_index, recompute); bases[i]: block i's canonical start (the anchor's length
    when compiled after it); seams[i]: tokens of block i computed at its start."""
    ops: list[Op] = []
    pos = 0
    first = 0
    segs = list(segments)
    if (len(segs) >= 2 and anchor and segs[0].kind == "text" and segs[0].ids == anchor and segs[1].kind == "skill"
            and bases[segs[1].skill_index] == len(anchor) and not segs[1].recompute):
        n = len(anchor) + len(segs[1].ids)  # the anchor and the first skill, exactly as compiled
        ops.append(Op("copy", 0, n, segs[1].skill_index, 0))
        pos, first = n, 2
    for seg in segs[first:]:
        if seg.kind == "text":
            ops.append(Op("compute", pos, len(seg.ids)))
            pos += len(seg.ids)
            continue
        i, n = seg.skill_index, len(seg.ids)
        spans = _merge([(0, min(seams[i], n)), *seg.recompute])
        cursor = 0
        for s, e in spans + [(n, n)]:
            if s > cursor:
                ops.append(Op("copy", pos + cursor, s - cursor, i, bases[i] + cursor))
            if e > s:
                ops.append(Op("compute", pos + s, e - s))
            cursor = max(cursor, e)
        pos += n
    while ops and ops[-1].kind == "compute":
        ops.pop()
    merged: list[Op] = []
    for op in ops:  # adjacent computed runs are one run
        if merged and op.kind == "compute" and merged[-1].kind == "compute" and op.n:
            merged[-1] = Op("compute", merged[-1].at, merged[-1].n + op.n)
        elif op.n:
            merged.append(op)
    return merged


def block_name(namespace: str, fingerprint: str, base_ids: list[int], ids: list[int]) -> str:
    """A block's saved record: the tokens of its canonical context and its own, per tenant."""
    raw = json.dumps([namespace, fingerprint, base_ids, ids]).encode()
    return "blk-" + hashlib.sha256(raw).hexdigest()[:40]


@dataclass(frozen=True)
class Chain:
    """The vLLM requests that build one composed head: `steps` in order (prompt length, transfer), then the final
    request's transfer (the whole head loaded)."""

    digest: str
    steps: tuple[tuple[int, Transfer], ...]
    final: Transfer
    n_head: int
    n_copied: int

    @classmethod
    def build(cls, ops: list[Op], names: list[str], digest: str) -> "Chain":
        """names[i]: block i's record. Step records are `step-<digest>-<j>`."""
        pieces: list[Piece] = []
        steps = []
        for op in ops:
            if op.kind == "copy":
                assert op.block is not None
                pieces.append(Piece(names[op.block], op.src, op.src + op.n, op.at))
                continue
            name = f"step-{digest}-{len(steps)}"
            steps.append((op.end, Transfer(tuple(pieces), Save(name, op.at, op.end))))
            pieces.append(Piece(name, op.at, op.end, op.at))
        n_copied = sum(op.n for op in ops if op.kind == "copy")
        return cls(digest, tuple(steps), Transfer(tuple(pieces)), ops[-1].end if ops else 0, n_copied)


def chain_digest(namespace: str, fingerprint: str, ids: list[int], ops: list[Op], names: list[str]) -> str:
    """What fixes a composed head's K/V: the tenant, the model, the head's ids and how each span is made."""
    n = ops[-1].end if ops else 0
    raw = json.dumps([namespace, fingerprint, ids[:n], [(o.kind, o.at, o.n, o.block, o.src) for o in ops],
                      names]).encode()
    return hashlib.sha256(raw).hexdigest()[:32]
