"""A session with a ~2k-token user memory and an edit every few turns: three arms side by side (issue 20).

    python bench/memory.py --json bench/out/memory.json [--turns 12] [--memory-tokens 2000] [--edit-every 3]

ours   the service in process: POST /v1/memories, then a session naming the memory. Each turn floats the memory's
       block, re-rotated, after the conversation and before the user turn, with a 1-token seam; the conversation's
       cache only grows. Edits by PATCH before the turn (erratum, recompile, in_place in turn).
full   the same layout and the very token ids of ours' turn, prefilled from scratch every turn: the token-identical
       full recompute that fidelity is measured against.
early  [system][skills][MEMORY][conversation][user]: the memory leads, the longest cached prefix is kept (prefix
       caching), so an edit re-prefills from the changed fact on, the whole conversation included.
All arms share ours' transcript. Controls on ours' turn (a copy of its cache, not timed): the memory's keys not
re-rotated (left where compiled), and no seam. Greedy decoding; the embedded model unless --model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from common import ROOT, load_runtime, write_json
from memory_data import memory_text, schedule

SYSTEM = "You are a support agent. Follow the user's settings in their memory."


class NoRotation:
    """The control: memory keys stay at the positions they were compiled at."""

    def check_tokens(self, ids):
        pass

    def move_layers(self, keys, values, delta):
        return list(keys), list(values)


def agreement(a, b) -> dict:
    from service.runtime.fidelity import logit_agreement

    return logit_agreement(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--chat-template", help="as SKILLCACHE_CHAT_TEMPLATE; one that keeps a system turn of its own "
                    "(the early arm prefills the system turn alone: Gemma-3's template, which folds it into the "
                    "first user turn, cannot)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--memory-tokens", type=int, default=2000)
    ap.add_argument("--edit-every", type=int, default=3)
    ap.add_argument("--skill", default="style-guide")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    from fastapi.testclient import TestClient
    from skillcache_client.skillfile import parse_skill_file

    import service.sessions.manager as manager
    from service.config import Settings
    from service.kv.cache import block_from_cache, cache_from_block, new_cache
    from service.main import create_app
    from service.runtime.decode import Done, generate
    from service.runtime.steps import run_steps
    from service.runtime.late import late_turn_steps
    from service.runtime.params import GenParams

    rt = load_runtime(args.model, chat_template=args.chat_template)
    gen = GenParams(max_tokens=args.max_tokens)
    mem, facts = memory_text(lambda t: len(rt.prompts.encode_content(t)), args.memory_tokens)
    plan_turns = schedule(facts, args.turns, args.edit_every)
    captured = []

    def capture(*a, **k):  # ours' first-token logits, as the service computes them
        pre = yield from late_turn_steps(*a, **k)
        captured.append(pre.logits.clone())
        return pre

    manager.late_turn_steps = capture
    settings = Settings(home=Path(tempfile.mkdtemp()), store="memory", skills_dir=None, seam_auto=False,
                        shadow_sample_rate=0.0, refine_after=0)
    spec = parse_skill_file(ROOT / "skills" / f"{args.skill}.md")
    with TestClient(create_app(settings, runtime=rt)) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        assert c.post("/v1/skills", json={"name": spec["name"], "text": spec["text"]}).status_code == 201
        t0 = time.perf_counter()
        m = c.post("/v1/memories", json={"name": "user", "text": mem}).json()
        s = c.post("/v1/sessions", json={"skills": [args.skill], "system": SYSTEM, "memory": "user"}).json()
        ours_setup_ms = (time.perf_counter() - t0) * 1e3
        sid, mgr = s["id"], state.sessions
        skill_ids = mgr.live[sid].skill_ids
        early_cache, early_ids = new_cache(rt.model.config), []
        t0 = time.perf_counter()
        head = rt.prompts.build([{"role": "system", "content": SYSTEM + "\n\n" + mem}], skill_ids,
                                add_generation_prompt=False)
        rt.forward(head.ids, 0, early_cache)  # the early arm's system turn, memory included, prefilled once
        early_ids, early_setup_ms = head.ids, (time.perf_counter() - t0) * 1e3
        print(f"memory {m['n_tokens']} tokens; ours setup {ours_setup_ms:.0f} ms, early setup {early_setup_ms:.0f} ms",
              flush=True)
        rows = []
        for t, step in enumerate(plan_turns):
            edit_ms, edit_report = 0.0, None
            if step["edit"]:
                t1 = time.perf_counter()
                r = c.patch("/v1/memories/user", json={"edits": [step["edit"]]})
                edit_ms, edit_report = (time.perf_counter() - t1) * 1e3, r.json()["edits"][0]
            live = mgr.live[sid]
            late = c.portal.call(state.memories.resolve, "default", "user")
            messages = live.messages + [{"role": "user", "content": step["user"]}]
            plan = rt.prompts.build(mgr._head(live) + messages, live.skill_ids, live.base_errata, late_ids=late.ids,
                                    late_lines=late.lines)

            def control(rotator=None, seam=None):  # ours' turn on a copy of the session's cache
                copy = cache_from_block(rt.model.config, block_from_cache(live.cache, live.ids, rt.fingerprint))
                seams = late.seams if seam is None else [seam] * len(late.blocks)
                pre = run_steps(late_turn_steps(rt, copy, live.ids, plan, late.blocks, seams, rotator=rotator))
                return pre.logits.clone(), [e for e in generate(rt, pre, gen) if isinstance(e, Done)][0].text

            (no_rot, no_rot_text), (no_seam, no_seam_text) = control(rotator=NoRotation()), control(seam=0)
            t1 = time.perf_counter()
            full = rt.prefill(plan, [], mode="full")
            full_ms = (time.perf_counter() - t1) * 1e3
            full_text = [e for e in generate(rt, full, gen) if isinstance(e, Done)][0].text
            captured.clear()
            r = c.post(f"/v1/sessions/{sid}/turns", json={"user": step["user"], "max_tokens": args.max_tokens}).json()
            assert r["usage"]["prompt_tokens"] == plan.n_tokens, "the full arm must prefill ours' very tokens"
            ours = agreement(captured[0], full.logits)
            memory_now = c.get("/v1/memories/user").json()["text"]
            early_plan = rt.prompts.build([{"role": "system", "content": SYSTEM + "\n\n" + memory_now}] + messages,
                                          skill_ids)
            t1 = time.perf_counter()
            pre = run_steps(rt.extend_steps(early_cache, early_ids, early_plan.ids))
            early_ms = (time.perf_counter() - t1) * 1e3
            reply = mgr.live[sid].messages[-1]
            reply_ids = reply.get("ids") or rt.prompts.encode_content(reply["content"])
            rt.forward(reply_ids, len(early_plan.ids), early_cache)  # its decode: the shared reply, not timed
            early_ids = early_plan.ids + reply_ids
            rows.append({
                "turn": t + 1, "edit": step["edit"] and step["edit"]["mode"], "edit_report": edit_report,
                "prompt_tokens": plan.n_tokens, "conversation_tokens": plan.late_span[0],
                "ours_ttft_ms": r["timings"]["ttft_ms"], "ours_store_ms": r["timings"]["store_ms"],
                "ours_edit_ms": edit_ms, "ours_memory_sources": [b["source"] for b in r["memory"]["blocks"]],
                "ours_recomputed": r["usage"]["recomputed_tokens"], "full_ttft_ms": full_ms,
                "full_recomputed": plan.n_tokens, "early_ttft_ms": early_ms, "early_recomputed": pre.n_recomputed,
                "cosine": ours["cosine"], "top1": ours["top1_agree"], "decisive": ours["decisive"], "kl": ours["kl"],
                "greedy_same": r["text"] == full_text, "ours_text": r["text"], "full_text": full_text,
                **{f"{name}_{k}": v for name, logits in (("norot", no_rot), ("noseam", no_seam))
                   for k, v in agreement(logits, full.logits).items() if k in ("cosine", "top1_agree", "kl")},
                "norot_greedy_same": no_rot_text == full_text, "noseam_greedy_same": no_seam_text == full_text})
            x = rows[-1]
            print(f"turn {x['turn']:2d} edit={str(x['edit']):9s} prompt={x['prompt_tokens']:5d} "
                  f"recomputed ours/early/full={x['ours_recomputed']}/{x['early_recomputed']}/{x['full_recomputed']} "
                  f"ttft ours={x['ours_ttft_ms']:.0f}+{edit_ms:.0f} early={early_ms:.0f} full={full_ms:.0f} ms "
                  f"cos={x['cosine']:.4f} top1={x['top1']} greedy={x['greedy_same']} "
                  f"norot={x['norot_cosine']:.4f}/{x['norot_top1_agree']}/{x['norot_greedy_same']} "
                  f"noseam={x['noseam_cosine']:.4f}/{x['noseam_greedy_same']}", flush=True)
    summary = summarize(rows, ours_setup_ms, early_setup_ms)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    write_json(args.json, {"model": rt.loaded.name, "memory_tokens": m["n_tokens"], "threads": torch.get_num_threads(),
                           "summary": summary, "turns": rows})


def summarize(rows: list[dict], ours_setup_ms: float, early_setup_ms: float) -> dict:
    n = len(rows)
    ours = sum(x["ours_ttft_ms"] for x in rows)
    edits = sum(x["ours_edit_ms"] for x in rows)
    full = sum(x["full_ttft_ms"] for x in rows)
    early = sum(x["early_ttft_ms"] for x in rows)
    return {
        "cumulative_ttft_ms": {"ours": ours, "ours_with_edits": ours + edits, "early": early, "full": full},
        "setup_ms": {"ours": ours_setup_ms, "early": early_setup_ms},
        "ratio_full_over_ours_with_edits": full / (ours + edits),
        "ratio_early_over_ours_with_edits": early / (ours + edits),
        "cosine_min": min(x["cosine"] for x in rows), "cosine_mean": sum(x["cosine"] for x in rows) / n,
        "top1_agreement": sum(x["top1"] for x in rows) / n,
        "greedy_agreement": sum(x["greedy_same"] for x in rows) / n,
        "kl_mean": sum(x["kl"] for x in rows) / n,
        **{f"{arm}_{k}": sum(x[f"{arm}_{key}"] for x in rows) / n for arm in ("norot", "noseam")
           for k, key in (("cosine_mean", "cosine"), ("top1_agreement", "top1_agree"), ("kl_mean", "kl"),
                          ("greedy_agreement", "greedy_same"))},
    }


if __name__ == "__main__":
    main()
