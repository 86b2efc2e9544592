"""Calibrated seams ("auto") against fixed seam sizes, and what calibration costs per skill.

    python bench/calibration.py --json bench/out/calibration.json [--model embedded]

1. Each shipped skill is calibrated as the service does after compiling it (service.runtime.calibrate,
   the Settings thresholds): the chosen seam, whether it met the thresholds, and the time it took.
2. The compositions of bench/fidelity.py part (a) are scored against full recompute with every
   skill at its calibrated seam ("auto") and at fixed seams: first-token cosine, KL, top-1 on
   decisive cases (the full recompute's top-1 leads by >= the tie margin), and the reused share.
"""

from __future__ import annotations

import argparse
import statistics

from common import load_runtime, write_json
from fidelity import COMPOSITIONS, QUESTIONS, SYSTEMS, shipped_skills  # fidelity.py part (a) cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--fixed", type=int, nargs="+", default=[0, 4, 32])
    ap.add_argument("--json")
    args = ap.parse_args()
    from service.config import Settings
    from service.runtime.calibrate import calibrate
    from service.runtime.fidelity import logit_agreement

    st = Settings()
    rt = load_runtime(args.model)
    skills = shipped_skills(rt)
    blocks = {name: rt.compile_block(ids) for name, ids in skills.items()}
    cal = {}
    print(f"{'skill':22s} {'tokens':>6s} {'seam':>5s} {'passed':>6s} {'cos min':>8s} {'ms':>8s}")
    for name, block in blocks.items():
        c = calibrate(rt, block, list(st.seam_candidates), st.fidelity_min_cosine, st.fidelity_tie_margin)
        cal[name] = c.to_dict()
        print(f"{name:22s} {block.n_tokens:6d} {c.seam:5d} {str(c.passed):>6s} {c.cosine_min:8.5f} {c.elapsed_ms:8.0f}")
    arms = {"auto": None, **{f"fixed {k}": k for k in args.fixed}}
    rows = {arm: [] for arm in arms}
    for names, sys_idx, about in COMPOSITIONS:
        msgs = [{"role": "system", "content": SYSTEMS[sys_idx]}, {"role": "user", "content": QUESTIONS[about]}]
        plan = rt.prompts.build(msgs, [skills[n] for n in names])
        bl = [blocks[n] for n in names]
        full = rt.prefill(plan, bl, mode="full").logits
        for arm, k in arms.items():
            seams = [cal[n]["seam"] for n in names] if k is None else k
            comp = rt.prefill(plan, bl, mode="compose", seam_tokens=seams)
            rows[arm].append({**logit_agreement(comp.logits, full, st.fidelity_tie_margin),
                              "reused": comp.n_reused / comp.n_prompt})
    print(f"\n{'arm':10s} {'mean cos':>9s} {'min cos':>8s} {'mean KL':>9s} {'top-1 (decisive)':>17s} {'reused':>7s}")
    summary = {}
    for arm, rs in rows.items():
        dec = [r for r in rs if r["decisive"]]
        s = {"mean_cosine": statistics.mean(r["cosine"] for r in rs), "min_cosine": min(r["cosine"] for r in rs),
             "mean_kl": statistics.mean(r["kl"] for r in rs),
             "top1_decisive": (sum(r["top1_agree"] for r in dec) / len(dec)) if dec else None,
             "n_decisive": len(dec), "n": len(rs), "reused_share": statistics.mean(r["reused"] for r in rs)}
        summary[arm] = s
        t1 = f"{s['top1_decisive']:.2f} ({len(dec)}/{len(rs)})" if dec else "n/a"
        print(f"{arm:10s} {s['mean_cosine']:9.5f} {s['min_cosine']:8.5f} {s['mean_kl']:9.4f} {t1:>17s} "
              f"{s['reused_share']:7.3f}")
    ms = [c["elapsed_ms"] for c in cal.values()]
    print(f"\ncalibration cost per skill: median {statistics.median(ms):.0f} ms, max {max(ms):.0f} ms")
    write_json(args.json, {"model": rt.loaded.name, "calibration": cal, "summary": summary, "cases": rows})


if __name__ == "__main__":
    main()
