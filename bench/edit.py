"""Editing a field inside cached context: stale vs in_place vs erratum vs field+erratum vs recompute.

    python bench/edit.py --json bench/out/edit.json [--model embedded | <HF id or dir>] [--device auto]

The paper's gated-decision shape (arXiv 2606.17107, on errata): each task is a skill with a field near the
top, a rule that gates a one-word decision on it, filler clauses, and a question. The field changes
from a value that gates action A to one that gates action B. At the first answer position:
score = logit[first token of B] - logit[first token of A]; recovery = (score_edit - score_stale) /
(score_oracle - score_stale) (cases with |oracle - stale| < 1e-4 skipped); agreement = the arm's
A-vs-B choice equals the oracle's. The oracle (`recompute`) is a full prefill of the new text.
Every arm uses the service's own code path: blocks compiled once, composed at their offset with the
default seam, edits planned by service.compose.edits.plan_edit.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import load_runtime, write_json

FILLER = [
    "Be courteous and address the requester by name when it is known.",
    "Record the decision and a one-line reason in the case log.",
    "Do not disclose internal tooling or staff names to the requester.",
    "Use the standard templates for any written confirmation.",
    "If the request is a duplicate, link it to the original case.",
    "Quote amounts with the currency symbol and two decimals.",
    "Respect the quiet hours for outbound notifications.",
    "Escalations must include the case number in the subject line.",
    "Keep personal data out of free-text notes.",
    "Check spelling of names against the account record.",
]
# (name, field, value gating A, value gating B, rule, action A, action B)
TASKS = [
    ("refund", "order_status", "delivered", "shipped",
     "If the order status is shipped, the answer is DENY; if it is delivered, the answer is APPROVE.",
     "APPROVE", "DENY"),
    ("access", "badge_state", "active", "revoked",
     "If the badge state is revoked, the answer is BLOCK; if it is active, the answer is GRANT.", "GRANT", "BLOCK"),
    ("deploy", "ci_status", "green", "red",
     "If the CI status is red, the answer is HOLD; if it is green, the answer is SHIP.", "SHIP", "HOLD"),
    ("rx", "allergy_flag", "none", "penicillin",
     "If the allergy flag is penicillin, the answer is REFUSE; if it is none, the answer is DISPENSE.",
     "DISPENSE", "REFUSE"),
    ("loan", "credit_band", "prime", "subprime",
     "If the credit band is subprime, the answer is REJECT; if it is prime, the answer is ACCEPT.", "ACCEPT", "REJECT"),
    ("legal", "contract_review", "cleared", "flagged",
     "If the contract review is flagged, the answer is ESCALATE; if it is cleared, the answer is SIGN.",
     "SIGN", "ESCALATE"),
    ("incident", "severity", "low", "critical",
     "If the severity is critical, the answer is PAGE; if it is low, the answer is QUEUE.", "QUEUE", "PAGE"),
    ("visa", "passport_status", "valid", "expired",
     "If the passport status is expired, the answer is DECLINE; if it is valid, the answer is ISSUE.",
     "ISSUE", "DECLINE"),
]
ARMS = ["stale", "in_place", "erratum", "field+erratum", "recompute"]


def task_text(task) -> str:
    name, fld, _, _, rule, a, b = task
    return (f"# SKILL: {name.upper()}_POLICY\nCurrent {fld.replace('_', ' ')}: {{{{{fld}}}}}\n"
            f"RULE: {rule}\n" + "\n".join(f"- {x}" for x in FILLER) + f"\nAnswer with one word: {a} or {b}.")


def run_task(rt, settings, task, seam: int) -> dict:
    from service.compose.edits import plan_edit
    from service.registry.skill import SkillRecord, content_hash

    name, fld, old, new, _, a, b = task
    text = task_text(task)
    rec = SkillRecord("bench", name, 1, text, content_hash(text, {fld: old}), 0, None, {fld: old})
    a_id, b_id = (rt.prompts.encode_content(w)[0] for w in (a, b))
    assert a_id != b_id, f"{task[0]}: action words share a first token"
    msgs = [{"role": "system", "content": "You are a policy engine. Reply with the decision word only."},
            {"role": "user", "content": f"Apply the {name} policy. What is the decision?"}]
    old_block = rt.compile_block(rt.prompts.encode_content(rec.default_text))
    out = {"task": name, "arms": {}}
    for arm in ARMS:
        mode = {"stale": None, "recompute": "recompile"}.get(arm, arm)
        edit = plan_edit(rt.prompts, rec, {fld: new} if mode else {}, mode or "erratum", settings.erratum_template)
        block = old_block if edit.text == rec.default_text else rt.compile_block(rt.prompts.encode_content(edit.text))
        plan = rt.prompts.build(msgs, [edit.ids or block.token_ids], errata=edit.errata)
        for seg in plan.segments:
            if seg.kind == "skill":
                seg.recompute = list(edit.recompute)
        t0 = time.perf_counter()
        pre = rt.prefill(plan, [block], mode="full" if arm == "recompute" else "compose", seam_tokens=seam)
        ms = (time.perf_counter() - t0) * 1e3
        score = float(pre.logits[b_id] - pre.logits[a_id])
        out["arms"][arm] = {"score": score, "choice": b if score > 0 else a, "prefill_ms": ms,
                            "recompute_fraction": pre.n_recomputed / pre.n_prompt, "mode_applied":
                            edit.report[0]["mode"] if edit.report else "none"}
    stale, oracle = out["arms"]["stale"]["score"], out["arms"]["recompute"]["score"]
    for arm in ARMS:
        r = out["arms"][arm]
        r["recovery"] = None if abs(oracle - stale) < 1e-4 else (r["score"] - stale) / (oracle - stale)
        r["agrees_with_oracle"] = r["choice"] == out["arms"]["recompute"]["choice"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seam", type=int, default=None, help="default: the service's seam_tokens")
    ap.add_argument("--json")
    args = ap.parse_args()
    from service.config import Settings

    settings = Settings()
    seam = settings.seam_tokens if args.seam is None else args.seam
    rt = load_runtime(args.model, args.device, args.dtype)
    rows = [run_task(rt, settings, t, seam) for t in TASKS]
    print(f"model={rt.loaded.name} seam={seam} tasks={len(rows)}")
    print(f"{'arm':15s} {'recovery mean':>14s} {'median':>7s} {'agree w/ oracle':>16s} {'recompute frac':>15s} "
          f"{'prefill ms':>11s}")
    summary = {}
    for arm in ARMS:
        recs = [r["arms"][arm]["recovery"] for r in rows if r["arms"][arm]["recovery"] is not None]
        s = {
            "recovery_mean": statistics.mean(recs) if recs else None,
            "recovery_median": statistics.median(recs) if recs else None,
            "agreement": sum(r["arms"][arm]["agrees_with_oracle"] for r in rows) / len(rows),
            "recompute_fraction": statistics.mean(r["arms"][arm]["recompute_fraction"] for r in rows),
            "prefill_ms_median": statistics.median(r["arms"][arm]["prefill_ms"] for r in rows),
        }
        summary[arm] = s
        rec = f"{s['recovery_mean']:14.2f} {s['recovery_median']:7.2f}" if recs else f"{'n/a':>14s} {'':7s}"
        print(f"{arm:15s} {rec} {s['agreement']:>16.2f} {s['recompute_fraction']:>15.3f} "
              f"{s['prefill_ms_median']:>11.1f}")
    flips = sum(r["arms"]["stale"]["choice"] != r["arms"]["recompute"]["choice"] for r in rows)
    gap = statistics.median(abs(r["arms"]["recompute"]["score"] - r["arms"]["stale"]["score"]) for r in rows)
    print(f"tasks where the oracle's decision differs from the stale one: {flips}/{len(rows)}; "
          f"median |score_oracle - score_stale| = {gap:.3f} logits")
    write_json(args.json, {"model": rt.loaded.name, "seam": seam, "summary": summary, "tasks": rows,
                           "oracle_flips": flips, "median_oracle_gap": gap})


if __name__ == "__main__":
    main()
