"""A composed head as vLLM runs it: which tokens are copied from saved blocks, which vLLM computes, in what steps.

The plan is the one the embedded engine's Composer executes (service/kv/plan.py: what is copied, rotated, computed).
The head ends with the last copied token; vLLM computes the rest of the prompt.

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

from service.kv.plan import Op, Plan, plan_ops
from service.vllm.transfer import Piece, Save, Transfer


def head_ops(segments, bases: list[int], seams: list[int], anchor: list[int]) -> list[Op]:
    return head_of(plan_ops(segments, bases, seams, anchor))


def head_of(plan: Plan) -> list[Op]:
    """The head of a composition plan (service/kv/plan.py), up to its last copied token (none: nothing to copy,
    vLLM computes it all): what vLLM's connector loads and the steps compute. Copies of one record that follow each
    other (the anchor and the first skill after it) are one piece."""
    ops = list(plan.ops)
    while ops and ops[-1].kind == "compute":
        ops.pop()
    out: list[Op] = []
    for op in ops:
        last = out[-1] if out else None
        if (last is not None and op.kind == "copy" and last.kind == "copy" and op.block == last.block
                and op.at == last.end and op.src == last.src + last.n):
            out[-1] = Op("copy", last.at, last.n + op.n, op.block, last.src, last.exact and op.exact)
        else:
            out.append(op)
    return out


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
        steps: list[tuple[int, Transfer]] = []
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
