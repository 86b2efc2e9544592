"""Composition vs the token-identical full prefill on Gemma-3-270M, for 1-3 shipped skills in different orders
(seam: the service default); every skill after the first is longer than the 512-token window and starts past it.
The figures it prints (pytest -s) are docs/BENCHMARKS.md's Gemma-3 row.

Asserted: a skill alone is exact (copied where it was compiled: KL ~0, same top-1, identical greedy
continuation); first-token cosine >= 0.99 in every case; the same top-1 wherever the full prefill's top-1 is
decisive (p1 - p2 >= 0.05). Printed, not asserted: top-1 over all cases and the greedy-24 match of compositions
of two or three skills (later skills never attended to the earlier ones, so continuations may part).
"""

import statistics

import pytest

from gemma_model import WINDOW, compare

from service.config import Settings

pytestmark = pytest.mark.slow

SYSTEMS = ["You are a support agent for an online store.",
           "You are a careful assistant. Follow the policies below exactly. Be concise and polite always."]
USERS = ["My order arrived 10 days ago, unused. Can I get a refund? Answer APPROVE or DENY first.",
         "Which tool should you call to look up an order, and why?"]
CASES = [
    ("refund-policy",), ("style-guide",),
    ("refund-policy", "style-guide"), ("style-guide", "refund-policy"), ("shipping-faq", "tool-specs"),
    ("refund-policy", "shipping-faq", "tool-specs"), ("tool-specs", "shipping-faq", "refund-policy"),
]
N_GREEDY = 24


def test_fidelity_table(gemma_runtime, gemma_skills):
    rt, seam = gemma_runtime, Settings().seam_tokens
    rows = []
    for k, names in enumerate(CASES):
        msgs = [{"role": "system", "content": SYSTEMS[k % 2]}, {"role": "user", "content": USERS[k % 2]}]
        plan = rt.prompts.build(msgs, [gemma_skills[n][0] for n in names])
        # every skill after the first is longer than the sliding window and starts past it
        assert all(o > WINDOW and len(gemma_skills[n][0]) > WINDOW for o, n in zip(plan.skill_offsets()[1:], names[1:]))
        fid = compare(rt, plan, [gemma_skills[n][1] for n in names], seam_tokens=seam, n_greedy=N_GREEDY)
        rows.append((names, plan.skill_offsets(), fid))
        print(f"{'+'.join(names):58s} offsets={plan.skill_offsets()} cos={fid['cosine']:.5f} kl={fid['kl']:.1e} "
              f"top1={int(fid['top1'])} decisive={int(fid['decisive'])} greedy{N_GREEDY}={int(fid['greedy'])} "
              f"agree={fid['greedy_prefix']} full's top-1 {rt.tokenizer.decode([fid['top_token']])!r}")
    for n in (1, 2, 3):
        fs = [f for names, _, f in rows if len(names) == n]
        print(f"{n} skill(s): {len(fs)} cases, cos min {min(f['cosine'] for f in fs):.5f} median "
              f"{statistics.median(f['cosine'] for f in fs):.5f}, KL mean {statistics.fmean(f['kl'] for f in fs):.1e} "
              f"max {max(f['kl'] for f in fs):.1e}, top-1 {sum(f['top1'] for f in fs)}/{len(fs)}, "
              f"greedy-{N_GREEDY} {sum(f['greedy'] for f in fs)}/{len(fs)}")
    fids = [f for _, _, f in rows]
    decisive = [f for f in fids if f["decisive"]]
    print(f"all: top-1 {sum(f['top1'] for f in fids)}/{len(fids)}, decisive {sum(f['top1'] for f in decisive)}/"
          f"{len(decisive)}, greedy-{N_GREEDY} {sum(f['greedy'] for f in fids)}/{len(fids)}")

    singles = [f for names, _, f in rows if len(names) == 1]
    assert all(f["kl"] < 1e-5 and f["top1"] and f["greedy"] for f in singles), singles
    assert all(f["cosine"] >= 0.99 for f in fids), [f["cosine"] for f in fids]
    assert all(f["top1"] for f in decisive), decisive
    assert len({tuple(o) for _, o, _ in rows}) >= 6  # the skills really sat at many different offsets
