"""Composition vs full recompute on the embedded model in every CPU weight format besides the default (float32 with
packed decode: tests/embedded/test_fidelity_embedded.py): bfloat16, int8 and w8a8 (SKILLCACHE_DTYPE /
SKILLCACHE_QUANTIZATION). Composition is relative to a full recompute on the same weights, in the same format.

Asserted for each format, on the shipped skills (one, two and three per prompt): first-token logit cosine >= 0.99,
and a skill alone (copied where it was compiled) close to its full prefill: KL < 0.01 for bfloat16 and int8, whose
bfloat16 activations round a 1e-6 upstream difference either way (float32 is exact there, KL < 1e-5; measured here
1e-3 to 3.5e-3, one non-decisive top-1 flipped on bfloat16), KL < 0.1 for w8a8 (measured 0.06: per-token int8
activations round differently when a prompt is cut in other pieces, which is why w8a8 is not the default). For
bfloat16 and int8 also the same top-1 wherever the full recompute's top-1 is decisive. Measured values and the
formats' speed: docs/BENCHMARKS.md, "CPU weight formats". On an x86 CPU without VNNI the service refuses w8a8
(service/runtime/quantize.py, w8a8_unfit), and that refusal is what the w8a8 case checks there.
"""

import pytest

from service.runtime.fidelity import compare

pytestmark = pytest.mark.slow

FORMATS = {"bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "w8a8": {"quantization": "w8a8"}}
CASES = [(0,), (0, 1), (2, 1, 0)]  # one, two and three skills (the suite runs near its 20 min: one single)
SYSTEM = "You are a support agent for an online store."
USER = "My order arrived 10 days ago, unused. Can I get a refund? Answer APPROVE or DENY first."


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compose_matches_full_recompute_in_each_format(fmt, shipped_skills):
    from embedded_model import embedded_settings
    from service.runtime import build_runtime
    from service.runtime.quantize import w8a8_unfit

    if fmt == "w8a8" and w8a8_unfit():  # no VNNI: the service refuses the format here (it would run ~20x slower)
        with pytest.raises(RuntimeError, match="needs a CPU with VNNI"):
            build_runtime(embedded_settings(**FORMATS[fmt]))
        return
    rt = build_runtime(embedded_settings(**FORMATS[fmt]))
    blocks = {name: rt.compile_block(ids) for name, _, ids in shipped_skills[:3]}
    results = []
    for combo in CASES:
        names = [shipped_skills[i][0] for i in combo]
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        plan = rt.prompts.build(msgs, [blocks[n].token_ids for n in names])
        fid = compare(rt, plan, [blocks[n] for n in names], seam_tokens=4)  # greedy runs: bench/formats.py
        results.append((names, fid))
        print(f"{fmt:9s} {'+'.join(names):50s} cos={fid.cosine:.5f} kl={fid.kl:.2e} top1={fid.top1_agree} "
              f"decisive={fid.decisive}")
    assert all(f.cosine >= 0.99 for _, f in results), results
    singles = [f for names, f in results if len(names) == 1]
    assert all(f.kl < (0.1 if fmt == "w8a8" else 0.01) for f in singles), singles
    if fmt != "w8a8":
        assert all(f.top1_agree for _, f in results if f.decisive), results
