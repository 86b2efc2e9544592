"""Composition vs full recompute on the embedded model, for the shipped skills.

Asserted: first-token logit cosine >= 0.99 in every case; a skill alone is exact (it sits right
after the template opening it was compiled after: KL ~0, identical greedy continuation); and the
same top-1 token wherever the full recompute's top-1 is decisive (probability margin >= 0.05 over
the runner-up). Not asserted, but printed (pytest -s): top-1 agreement over all cases. The greedy 32-token
match over all cases is bench/fidelity.py's (recorded in docs/BENCHMARKS.md); here only the single skills
decode, where it is asserted. With two or three skills the later ones never
saw the earlier ones (KL ~0.01-0.04), and SmolLM2-135M sits near ties often enough that greedy
continuations part within 32 tokens in about half of those cases: the target "greedy-32 identical in
>= 90% of cases" is not met on this model (measured 7/14).
"""

import statistics

import pytest

from service.runtime.steps import run_steps
from service.runtime.fidelity import compare

pytestmark = pytest.mark.slow

SYSTEMS = ["You are a support agent for an online store.",
           "You are a careful assistant. Follow the policies below exactly. Be concise and polite always."]
USERS = ["My order arrived 10 days ago, unused. Can I get a refund? Answer APPROVE or DENY first.",
         "Which tool should you call to look up an order, and why?"]


def _cases(skills):
    n = len(skills)
    singles = [(i,) for i in range(n)]
    pairs = [(1, 0), (5, 3)]  # bench/fidelity.py runs more orders; the suite runs near its 20 minutes
    triples = [(0, 1, 2), (4, 0, 5)]
    return singles + [p for p in pairs if max(p) < n] + [t for t in triples if max(t) < n]


def test_compose_matches_full_recompute_on_shipped_skills(embedded_runtime, shipped_skills):
    rt = embedded_runtime
    seam = 4  # the service default (Settings.seam_tokens)
    blocks = {name: rt.compile_block(ids) for name, _, ids in shipped_skills}
    results = []
    for k, combo in enumerate(_cases(shipped_skills)):
        names = [shipped_skills[i][0] for i in combo]
        msgs = [{"role": "system", "content": SYSTEMS[k % 2]}, {"role": "user", "content": USERS[k % 2]}]
        plan = rt.prompts.build(msgs, [blocks[n].token_ids for n in names])
        fid = compare(rt, plan, [blocks[n] for n in names], seam_tokens=seam, n_greedy=32 if len(combo) == 1 else 0)
        results.append((names, plan.skill_offsets(), fid))
        print(f"{'+'.join(names):60s} offsets={plan.skill_offsets()} cos={fid.cosine:.5f} "
              f"top1={fid.top1_agree} greedy32={fid.greedy_match} prefix={fid.greedy_prefix}")
    cosines = [f.cosine for _, _, f in results]
    print(f"cases={len(results)} cos min={min(cosines):.5f} median={statistics.median(cosines):.5f} "
          f"top1={sum(f.top1_agree for *_, f in results)}/{len(results)}")
    assert all(c >= 0.99 for c in cosines), cosines
    singles = [f for names, _, f in results if len(names) == 1]
    # one skill: it sits right after the template opening it was compiled after, so it is exact
    assert all(f.kl < 1e-5 and f.top1_agree and f.greedy_match for f in singles), singles
    decisive = [f for _, _, f in results if f.decisive]
    print(f"decisive cases: {len(decisive)}; top-1 agreement there: {sum(f.top1_agree for f in decisive)}")
    assert len(decisive) >= 3, "too few decisive cases to say anything: the check would pass vacuously"
    assert all(f.top1_agree for f in decisive)
    multi = [tuple(o) for names, o, _ in results if len(names) > 1]
    assert len(set(multi)) == len(multi) >= 4  # skills really sat at many different offsets: each order its own


def test_refined_sequences_match_full_recompute(embedded_runtime, shipped_skills):
    """What the service serves once a skill sequence repeats (service/refine.py): the prompt through the last
    skill prefilled in chunks and copied as an exact prefix. Cases that composition alone does not get right."""
    rt = embedded_runtime
    blocks = {name: rt.compile_block(ids) for name, _, ids in shipped_skills}
    for k, combo in enumerate([(0, 1), (4, 0, 5)]):
        names = [shipped_skills[i][0] for i in combo]
        msgs = [{"role": "system", "content": SYSTEMS[k % 2]}, {"role": "user", "content": USERS[k % 2]}]
        plan = rt.prompts.build(msgs, [blocks[n].token_ids for n in names])
        prefix = run_steps(rt.exact_prefix_steps(plan.ids[:plan.skill_ends()[-1]], chunk=512))
        fid = compare(rt, plan, [blocks[n] for n in names], seam_tokens=4, n_greedy=32, prefix=prefix)
        print(f"{'+'.join(names):60s} refined: cos={fid.cosine:.7f} kl={fid.kl:.1e} greedy32={fid.greedy_match}")
        assert fid.kl < 1e-5 and fid.top1_agree and fid.greedy_match, fid


def test_no_rerotation_control_is_worse(embedded_runtime, shipped_skills):
    """Splicing keys without moving them must measurably hurt (so the test above can fail)."""
    rt = embedded_runtime
    name, _, ids = shipped_skills[0]
    block = rt.compile_block(ids)
    # place the block far from position 0 so that moving it matters
    _, _, ids2 = shipped_skills[1]
    msgs = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": USERS[0]}]
    plan = rt.prompts.build(msgs, [ids2, ids])
    blocks = [rt.compile_block(ids2), block]
    good = compare(rt, plan, blocks, seam_tokens=4)
    original = rt.rotator.rotate_layers
    rt.rotator.rotate_layers = lambda keys, delta: list(keys)
    try:
        naive = compare(rt, plan, blocks, seam_tokens=4)
    finally:
        rt.rotator.rotate_layers = original
    print(f"rotated cos={good.cosine:.5f} kl={good.kl:.5f}; naive cos={naive.cosine:.5f} kl={naive.kl:.5f}")
    assert naive.kl > 2 * good.kl and naive.cosine < good.cosine  # measured: 3.1x


def test_selfcheck_passes_on_embedded(embedded_runtime):
    from service.runtime.selfcheck import run_selfcheck

    rep = run_selfcheck(embedded_runtime)
    assert rep.ok, rep


def test_converted_model_reloads_with_identical_logits(embedded_runtime, tmp_path):
    """The cached safetensors conversion gives the same logits as the GGUF it came from."""
    import torch
    from transformers import AutoModelForCausalLM

    from service.runtime.loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([embedded_runtime.prompts.encode_content("Refunds are allowed within 30 days.")])
    with torch.inference_mode():
        a = ref(input_ids=ids).logits
        b = embedded_runtime.model(input_ids=ids).logits
    assert torch.equal(a, b)
