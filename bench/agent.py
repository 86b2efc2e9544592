"""A multi-turn agent session vs full re-prefill every turn (arXiv 2606.17107, agents and sessions).

    python bench/agent.py --json bench/out/agent.json [--turns 10] [--skill refund-policy]

Session arm: POST /v1/sessions with the policy skill (composed once), then 10 turns through
/v1/sessions/{id}/turns, the order status flipping every few turns (applied as erratum lines);
each turn prefills only its new tokens. Full arm: for every turn, a full prefill of exactly the
tokens the session holds for that turn, then greedy decoding. Reported: cumulative first-token
latency of both arms and their ratio, and per-turn agreement (first token, and the whole greedy
reply). In-process app (no HTTP socket), the embedded model, greedy decoding.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import ROOT, load_runtime, write_json

USERS = ["Order 1042 arrived and is unused. Can I return it for a refund?",
         "What about order 1043, same situation?",
         "And if the customer is a gold member?",
         "Check order 1044 for me, please.",
         "The customer insists. Final answer?",
         "Can you summarise the decision in one line?",
         "Would a store credit be possible instead?",
         "What do I tell the customer now?",
         "Any exception for damaged items?",
         "Please confirm the decision once more."]
STATUS = ["delivered", "delivered", "shipped", "shipped", "delivered", "delivered", "shipped", "delivered",
          "delivered", "shipped"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--skill", default="refund-policy")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    from service.config import Settings
    from service.main import create_app
    from service.runtime.decode import Done, generate
    from service.runtime.params import GenParams

    rt = load_runtime(args.model)
    settings = Settings(home=Path(tempfile.mkdtemp()), store="memory", skills_dir=ROOT / "skills")
    with TestClient(create_app(settings, runtime=rt)) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.portal.call(state.pipeline.guard.drain)  # the shipped skills' seam calibration, done at start-up
        t0 = time.perf_counter()
        s = c.post("/v1/sessions", json={"skills": [args.skill], "system": "You are a support agent.",
                                         "fields": {"order_status": STATUS[0]}}).json()
        create_ms = (time.perf_counter() - t0) * 1e3
        sid, mgr, rows = s["id"], state.sessions, []
        for turn in range(args.turns):
            user, status = USERS[turn % len(USERS)], STATUS[turn % len(STATUS)]
            live = mgr.live[sid]
            tmpl = settings.erratum_template
            errata = [tmpl.format(field="order_status", value=status)] if live.fields["order_status"] != status else []
            content = "\n".join(errata) + "\n\n" + user if errata else user
            plan = rt.prompts.build(mgr._head(live) + live.messages + [{"role": "user", "content": content}],
                                    live.skill_ids, live.base_errata)
            t1 = time.perf_counter()
            full = rt.prefill(plan, [], mode="full")
            full_ms = (time.perf_counter() - t1) * 1e3
            full_done = [e for e in generate(rt, full, GenParams(max_tokens=args.max_tokens)) if isinstance(e, Done)][0]
            r = c.post(f"/v1/sessions/{sid}/turns", json={"user": user, "fields": {"order_status": status},
                                                           "max_tokens": args.max_tokens}).json()
            same_first = full_done.text.split()[:1] == r["text"].split()[:1]
            rows.append({"turn": turn + 1, "status": status, "erratum": bool(errata), "prompt_tokens": plan.n_tokens,
                         "session_recomputed": r["usage"]["recomputed_tokens"],
                         "session_ttft_ms": r["timings"]["ttft_ms"],
                         "full_ttft_ms": full_ms, "first_word_agree": same_first,
                         "reply_identical": full_done.text == r["text"]})
            print(f"turn {turn + 1:2d} status={status:9s} prompt={plan.n_tokens:5d} "
                  f"recomputed={rows[-1]['session_recomputed']:4d} "
                  f"session={r['timings']['ttft_ms']:7.1f} ms full={full_ms:7.1f} ms agree={same_first} "
                  f"identical={rows[-1]['reply_identical']}", flush=True)
    cum_session = create_ms + sum(x["session_ttft_ms"] for x in rows)
    cum_full = sum(x["full_ttft_ms"] for x in rows)
    summary = {"cumulative_session_ms": cum_session, "session_create_ms": create_ms, "cumulative_full_ms": cum_full,
               "ttft_ratio": cum_full / cum_session,
               "first_word_agreement": sum(x["first_word_agree"] for x in rows) / len(rows),
               "reply_identical": sum(x["reply_identical"] for x in rows) / len(rows)}
    print({k: round(v, 3) for k, v in summary.items()})
    write_json(args.json, {"model": rt.loaded.name, "summary": summary, "turns": rows})


if __name__ == "__main__":
    main()
