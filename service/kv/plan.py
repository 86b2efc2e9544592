"""The composition plan: which prompt tokens are copied from a compiled block (re-rotated to their place) and which
the model computes (seams, edited spans, the text between blocks). Plain data, no torch.

One plan, two executors: the embedded engine's Composer (service/runtime/composer.py) copies and computes in this
process; the vLLM engine turns the head of the same plan into connector loads and vLLM steps (service/vllm/chain.py).

The rules:
- A prompt that opens with the anchor and then a skill compiled after that same anchor copies the anchor from that
  block's compilation (it is exact), and the skill as is, with no seam, unless the skill has edited spans.
- Every other block is copied re-rotated to its offset, except its first `seam` tokens and its edited spans, which
  are computed against what precedes them.
- Text segments are computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping, non-empty [start, end) spans."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(x for x in spans if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


@dataclass(frozen=True)
class Op:
    kind: str  # "copy" | "compute"
    at: int  # first prompt position
    n: int
    block: int | None = None  # copy: the block's index in the request's blocks
    src: int = 0  # copy: canonical position of its first token (block i's token j sits at bases[i] + j; below the
    # base: the anchor it was compiled after)
    exact: bool = False  # copy: what a full prefill computes there (the anchor, a first skill right after it)

    @property
    def end(self) -> int:
        return self.at + self.n


@dataclass
class Plan:
    ops: list[Op]  # in prompt order, tiling [start, end of the prompt)
    seams: dict[int, int] = field(default_factory=dict)  # skill index -> its seam tokens computed
    n_exact: int | None = None  # where the first re-rotated copy starts (None: no such copy)


def plan_ops(segments, bases: list[int], seams, anchor: list[int], start: int = 0) -> Plan:
    """The plan of `segments` (each: kind "text"|"skill", ids, skill_index, recompute spans), which start at prompt
    position `start` (after an exact prefix, if any: then no anchor rule). bases[i]: block i's canonical start (the
    anchor's length when compiled after it, 0 alone); seams: one int, or one per block."""
    segs = list(segments)
    ops: list[Op] = []
    out = Plan(ops)
    pos, first, exact_first = start, 0, None
    a = len(anchor)
    if (start == 0 and a and len(segs) >= 2 and segs[0].kind == "text" and segs[0].ids == anchor
            and segs[1].kind == "skill" and bases[segs[1].skill_index] == a):
        exact_first = segs[1].skill_index
        ops.append(Op("copy", 0, a, exact_first, 0, exact=True))
        pos, first = a, 1
    for seg in segs[first:]:
        if seg.kind == "text":
            ops.append(Op("compute", pos, len(seg.ids)))
            pos += len(seg.ids)
            continue
        i, n = seg.skill_index, len(seg.ids)
        seam = seams[i] if isinstance(seams, list) else seams
        exact = i == exact_first and not seg.recompute  # edited: tokens after the edit are stale, so not exact
        out.seams[i] = 0 if exact else min(seam, n)
        cursor = 0
        for s, e in merge_spans([(0, out.seams[i]), *seg.recompute]) + [(n, n)]:
            if s > cursor:
                ops.append(Op("copy", pos + cursor, s - cursor, i, bases[i] + cursor, exact))
                if not exact and out.n_exact is None:
                    out.n_exact = pos + cursor
            if e > s:
                ops.append(Op("compute", pos + s, e - s))
            cursor = max(cursor, e)
        pos += n
    merged: list[Op] = []
    for op in ops:  # adjacent computed runs are one run
        if merged and op.kind == "compute" and merged[-1].kind == "compute":
            merged[-1] = Op("compute", merged[-1].at, merged[-1].n + op.n)
        elif op.n:
            merged.append(op)
    out.ops = merged
    return out
