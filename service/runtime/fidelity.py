"""Compose vs the token-identical full recompute: logit cosine, top-1, KL, greedy continuation match."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from service.kv.block import KVBlock
from service.runtime.decode import Done, GenParams, generate
from service.runtime.model import ModelRuntime
from service.runtime.prompt import PromptPlan


@dataclass
class Fidelity:
    cosine: float  # first-token logits
    top1_agree: bool
    decisive: bool  # the full recompute's top-1 leads the runner-up by a clear margin (p1 - p2 >= 0.05)
    kl: float  # KL(full || compose) of the first-token distribution
    greedy_match: bool | None  # identical greedy continuation of n_greedy tokens
    greedy_prefix: int | None  # tokens before the first divergence
    n_prompt: int
    n_reused: int

    def to_dict(self) -> dict:
        return asdict(self)


def _greedy(rt: ModelRuntime, pre, n: int) -> list[int]:
    done = [ev for ev in generate(rt, pre, GenParams(max_tokens=n)) if isinstance(ev, Done)][0]
    return done.token_ids


def logit_agreement(a: torch.Tensor, b: torch.Tensor, tie_margin: float = 0.05) -> dict:
    """Composed logits `a` vs full-recompute logits `b` ([V]): cosine, top-1, decisiveness, KL(b || a)."""
    a, b = a.float(), b.float()
    p = torch.topk(torch.softmax(b, -1), 2).values
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "top1_agree": bool(a.argmax() == b.argmax()),
        "decisive": float(p[0] - p[1]) >= tie_margin,
        "kl": float(torch.nn.functional.kl_div(torch.log_softmax(a, -1), torch.log_softmax(b, -1),
                                               log_target=True, reduction="sum")),
    }


def compare(
    rt: ModelRuntime, plan: PromptPlan, blocks: list[KVBlock], seam_tokens: int | list[int], n_greedy: int = 0,
    tie_margin: float = 0.05, prefix: KVBlock | None = None,
) -> Fidelity:
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=seam_tokens, prefix=prefix)
    full = rt.prefill(plan, blocks, mode="full")
    agree = logit_agreement(comp.logits, full.logits, tie_margin)
    match = prefix = None
    if n_greedy:
        g_full = _greedy(rt, full, n_greedy)
        g_comp = _greedy(rt, comp, n_greedy)
        match = g_full == g_comp
        prefix = next((i for i, (x, y) in enumerate(zip(g_full, g_comp)) if x != y), min(len(g_full), len(g_comp)))
    return Fidelity(agree["cosine"], agree["top1_agree"], agree["decisive"], agree["kl"], match, prefix,
                    plan.n_tokens, comp.n_reused)
