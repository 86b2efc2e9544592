"""Fidelity on vLLM, as vLLM requests: a composed prompt's first-token distribution against vLLM's full prefill of
the same ids. vLLM returns the top-k logprobs of a position (at most its max_logprobs, 20 by default), not the
logits, so the embedded engine's logit cosine (service/runtime/fidelity.py) has no counterpart here; what is
compared:
  top1_agree  the composed top-1 token is the full prefill's
  decisive    the full prefill's top-1 beats its runner-up by at least the tie margin in probability (a near-tie flips
              under any perturbation, even float rounding, and says nothing about the method)
  tv          total variation distance between the two top-k distributions (tokens missing from one side count as 0
              there): 0 identical, 1 disjoint
A check passes when the top-1 agrees or the full prefill's top-1 is not decisive: the same top-1 rule as the
embedded engine's shadow checks and calibration.
"""

from __future__ import annotations

import math

TOP_K = 20  # vLLM's default max_logprobs


def top_agreement(composed: list[tuple[str, float]], full: list[tuple[str, float]], tie_margin: float) -> dict:
    """composed, full: (token, logprob) of the first generated position, best first."""
    if not composed or not full:
        raise ValueError("vLLM returned no logprobs for the first generated position")
    p = {t: math.exp(lp) for t, lp in full}
    q = {t: math.exp(lp) for t, lp in composed}
    probs = sorted(p.values(), reverse=True) + [0.0]
    decisive = probs[0] - probs[1] >= tie_margin
    tv = 0.5 * sum(abs(p.get(t, 0.0) - q.get(t, 0.0)) for t in set(p) | set(q))
    top1 = composed[0][0] == full[0][0]
    return {"top1_agree": top1, "decisive": decisive, "tv": round(tv, 6), "ok": top1 or not decisive,
            "top1_composed": composed[0][0], "top1_full": full[0][0]}
