"""Seam calibration: the smallest seam that makes composition match full recompute for a skill.

Probe contexts place the skill first (after the template opening it was compiled after, so exact at
any seam) and second, after a neighbour skill that is recomputed in full; for each candidate seam
size (ascending) the composed first-token logits are compared with the full
recompute of the same ids. A candidate passes when every probe's logit cosine reaches
`min_cosine` and the top-1 token agrees on the probes whose full-recompute top-1 is decisive
(probability margin over the runner-up >= `tie_margin`; near-ties flip under any perturbation,
even float rounding, and say nothing about the method). No passing candidate -> the whole block.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from service.kv.block import KVBlock
from service.runtime.model import ModelRuntime
from service.runtime.steps import BACKGROUND_CHUNK_TOKENS, Steps, run_steps

_PROBES = [  # (system text, neighbour text or None, user turn)
    ("You are a helpful assistant.", None, "What should I do first?"),
    ("You are a support agent for a large online store. Answer precisely, cite the rule you apply, and keep "
     "the reply short.", "Context: the customer has contacted us twice this week about the same order.",
     "Summarise the most important rule above."),
]


@dataclass
class Calibration:
    seam: int
    passed: bool  # False: no candidate met the thresholds; `seam` is the whole block
    cosine_min: float
    top1_agree: float  # over decisive probes
    n_probes: int
    min_cosine: float
    elapsed_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def _decisive(logits: torch.Tensor, margin: float) -> bool:
    p = torch.topk(torch.softmax(logits.float(), -1), 2).values
    return float(p[0] - p[1]) >= margin


def calibration_steps(rt: ModelRuntime, block: KVBlock, candidates: list[int], min_cosine: float,
                      tie_margin: float, chunk: int = BACKGROUND_CHUNK_TOKENS) -> Steps:
    """Calibration as steps of at most `chunk` tokens through the model (engine.Steps): the serving engine runs
    them in its background share, so a live request waits behind one step of calibration work at most."""
    t0 = time.perf_counter()
    cases = []  # (plan, blocks, full-recompute logits, seams for a candidate k)
    for system, neighbour_text, user in _PROBES:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        if neighbour_text:  # a skill before this one, always recomputed whole: only this block's seam varies
            n_ids = rt.prompts.encode_content(neighbour_text)
            neighbour = yield from rt.compile_block_steps(n_ids, chunk=chunk)  # its tensors go unused
            blocks = [neighbour, block]
            seams = lambda k, n=len(n_ids): [n, k]  # noqa: E731
        else:
            blocks, seams = [block], lambda k: k  # noqa: E731
        plan = rt.prompts.build(msgs, [b.token_ids for b in blocks])
        _, full = yield from rt.full_prefill_steps(plan.ids, chunk)
        cases.append((plan, blocks, full, seams))
    best = None
    for k in sorted(set(c for c in candidates if c < block.n_tokens)) + [block.n_tokens]:
        cos, agree, decisive = 1.0, 0, 0
        for plan, blocks, full, seams in cases:
            comp = (yield from rt.prefill_steps(plan, blocks, mode="compose", seam_tokens=seams(k), chunk=chunk)).logits
            cos = min(cos, float(torch.nn.functional.cosine_similarity(comp, full, dim=0)))
            if _decisive(full, tie_margin):
                decisive += 1
                agree += int(comp.argmax() == full.argmax())
        top1 = agree / decisive if decisive else 1.0
        best = (k, cos, top1)
        if cos >= min_cosine and top1 >= 1.0:
            break
    k, cos, top1 = best
    passed = cos >= min_cosine and top1 >= 1.0
    return Calibration(k, passed, cos, top1, len(cases), min_cosine, (time.perf_counter() - t0) * 1e3)


def calibrate(rt: ModelRuntime, block: KVBlock, candidates: list[int], min_cosine: float,
              tie_margin: float) -> Calibration:
    """Run every calibration step inline (tests, benchmarks)."""
    return run_steps(calibration_steps(rt, block, candidates, min_cosine, tie_margin))
