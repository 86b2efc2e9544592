"""Fidelity of skillcache on vLLM: first-token top-1 agreement with vLLM's own full prefill, beside the embedded
engine's on the same cases; and refined heads' greedy continuations against vLLM alone.

    python bench/fidelity_vllm.py --json bench/out/fidelity-vllm.json [--cases 24] [--model embedded|<gguf>]
        [--dtype float32|bfloat16]

One vLLM server (--dtype: by default the fastest here, service.vllm.launch.fastest_dtype; skillcache's connector, its
spans in a temporary folder) and two skillcache services on the same weights: one with SKILLCACHE_ENGINE=vllm, one
embedded (in its own dtype); refinement off in both (SKILLCACHE_VLLM_REFINE_AFTER=0 and SKILLCACHE_REFINE_AFTER=0:
every case composed). Cases: the shipped skills in orders of two and three, each with a user turn. For each case:
  reference  vLLM alone computes the whole prompt (a salt no other request uses): its top-1 first token and its
             first --case-tokens greedy tokens (a base model may open every reply alike: the text tells more)
  vllm       skillcache on vLLM, composed inside vLLM (blocks compiled by vLLM, seams and turn computed by it, the
             saved K/V copied re-rotated by the connector)
  embedded   skillcache's own engine, composed
`--refined`: then each order once more through skillcache on vLLM with refinement on (SKILLCACHE_VLLM_REFINE_AFTER=1),
after vLLM has prefilled its exact head, against vLLM alone on the same ids: the first --greedy-tokens greedy tokens,
against vLLM alone's cold prompt and against vLLM alone's second send of it (a repeated prompt: its head read from
vLLM's prefix cache, as the refined order's is). In bfloat16 the two can differ: vLLM's K/V computed beside a cached
prefix round differently from its whole-prompt prefill (bench/vllm_prefix_rounding.py).
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from peers_work import Prompts

from service.devserver import ROOT, ServiceProcess, free_port
from service.vllm.launch import SERVED_NAME, VllmProcess, command, environment, fastest_dtype, model_dir

SHIPPED = ["refund-policy", "shipping-faq", "style-guide", "tool-specs", "account-security", "escalation-playbook"]
TURNS = ["A customer asks for a refund on a jacket bought 40 days ago. What do I answer?",
         "Which tool looks up an order, and with which arguments?",
         "The customer says their password was changed without them. What now?",
         "Can we ship to Canada, and how long does it take?",
         "Reply to an angry customer whose parcel is late, in our house style.",
         "When must I escalate a ticket to a supervisor?"]


def vllm_first(url: str, ids: list[int], n: int, salt: str) -> tuple[str, str]:
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": n, "temperature": 0.0, "logprobs": 1,
            "cache_salt": salt}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    top = ch["logprobs"]["top_logprobs"][0]
    return max(top, key=top.get), ch["text"]


def skillcache_first(url: str, order, user: str, n: int) -> tuple[str, str, dict]:
    body = {"skills": list(order), "user": user, "max_tokens": n, "temperature": 0.0, "logprobs": 1}
    r = httpx.post(f"{url}/v1/compose", json=body, timeout=600)
    r.raise_for_status()
    d = r.json()
    return d["logprobs"][0]["token"], d["text"], d["usage"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--refined", type=int, default=4, help="orders checked after refinement (0: none)")
    ap.add_argument("--greedy-tokens", type=int, default=32, help="refined heads: greedy tokens compared")
    ap.add_argument("--case-tokens", type=int, default=16,
                    help="each case: greedy tokens compared with vLLM's full prefill (beside the first token's top-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="embedded", help="SKILLCACHE_MODEL of both services (a .gguf: converted once)")
    ap.add_argument("--chat-template", default=None, help="SKILLCACHE_CHAT_TEMPLATE (gemma for Gemma-3-270M)")
    ap.add_argument("--dtype", default=fastest_dtype()[0],
                    help="vLLM's --dtype and SKILLCACHE_VLLM_DTYPE (default: the fastest here, bfloat16 on a GPU or a "
                    "CPU with bfloat16 instructions, float32 on other CPUs)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "fidelity-vllm.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    orders = [o for k in (2, 3) for o in itertools.permutations(SHIPPED, k)]
    rng.shuffle(orders)
    cases = [(orders[i], TURNS[i % len(TURNS)]) for i in range(args.cases)]
    prompts = Prompts(SHIPPED, args.model, args.chat_template)
    home = Path(tempfile.mkdtemp(prefix="skillcache-fidelity-vllm-"))
    (home / "skills").mkdir()
    for name in SHIPPED:
        shutil.copy(ROOT / "skills" / f"{name}.md", home / "skills")
    from service.config import Settings

    vllm = VllmProcess(command(model_dir(Settings(model=args.model)), free_port(), home / "spans", dtype=args.dtype),
                       environment(), home / "vllm.log")
    base = {"SKILLCACHE_SKILLS_DIR": str(home / "skills"), "SKILLCACHE_REFINE_AFTER": "0",
            "SKILLCACHE_MODEL": args.model, "SKILLCACHE_TORCH_THREADS": "1"}
    if args.chat_template:
        base["SKILLCACHE_CHAT_TEMPLATE"] = args.chat_template
    on_vllm_env = {**base, "SKILLCACHE_ENGINE": "vllm", "SKILLCACHE_VLLM_DTYPE": args.dtype,
                   "SKILLCACHE_VLLM_SPANS_DIR": str(home / "spans")}
    out: dict = {"dtype": args.dtype, "cases": [], "refined": []}
    t0 = time.perf_counter()
    try:
        vllm.start().wait_ready(900)
        on_vllm = ServiceProcess(home / "sc-vllm", {**on_vllm_env, "SKILLCACHE_VLLM_URL": vllm.url,
                                                    "SKILLCACHE_VLLM_REFINE_AFTER": "0"},
                                 name="skillcache-vllm", threads=2).start()
        embedded = ServiceProcess(home / "sc-embedded", base, name="embedded", threads=2).start()
        for svc in (on_vllm, embedded):
            svc.wait_ready(900)
        for order, user in cases:
            ids = prompts.ids(order, user)
            n = args.case_tokens
            ref, ref_text = vllm_first(vllm.url, ids, n, f"reference-{uuid.uuid4()}")
            tv, text_v, uv = skillcache_first(on_vllm.url, order, user, n)
            te, text_e, ue = skillcache_first(embedded.url, order, user, n)
            out["cases"].append({"order": list(order), "user": user, "n_ids": len(ids), "reference": ref,
                                 "vllm": tv, "embedded": te, "vllm_composed": uv["composed_tokens"],
                                 "embedded_composed": ue["composed_tokens"], "reference_text": ref_text,
                                 "vllm_text": text_v, "embedded_text": text_e})
            print(f"{len(out['cases']):3d} {ref!r:14} vllm {tv!r:14} embedded {te!r:14} "
                  f"(composed {uv['composed_tokens']}/{uv['prompt_tokens']}); greedy-{n} identical: "
                  f"vllm {text_v == ref_text}, embedded {text_e == ref_text}", flush=True)
        on_vllm.stop()
        if args.refined:
            refined = ServiceProcess(home / "sc-vllm-refined", {**on_vllm_env, "SKILLCACHE_VLLM_URL": vllm.url,
                                                                "SKILLCACHE_VLLM_REFINE_AFTER": "1"},
                                     name="skillcache-vllm-refined", threads=2).start()
            refined.wait_ready(900)
            for order, user in cases[:args.refined]:
                skillcache_first(refined.url, order, "Hello.", 1)  # composed once: vLLM prefills the exact head after
                time.sleep(1.0)
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    _, text, u = skillcache_first(refined.url, order, user, args.greedy_tokens)
                    if u["prefix_tokens"] > 0 and u["composed_tokens"] == 0:
                        break
                    time.sleep(2.0)
                ids = prompts.ids(order, user)
                salt = f"alone-{uuid.uuid4()}"
                _, alone = vllm_first(vllm.url, ids, args.greedy_tokens, salt)  # cold
                _, again = vllm_first(vllm.url, ids, args.greedy_tokens, salt)  # its head from vLLM's prefix cache
                out["refined"].append({"order": list(order), "user": user, "prefix_tokens": u["prefix_tokens"],
                                       "identical": text == alone, "identical_to_repeat": text == again,
                                       "alone_repeat_identical": again == alone, "skillcache": text,
                                       "vllm_alone": alone, "vllm_alone_repeat": again})
                print(f"refined {order}: prefix {u['prefix_tokens']}, identical to vLLM alone's cold prompt "
                      f"{text == alone}, to its repeat {text == again} (its repeat to its cold prompt "
                      f"{again == alone})", flush=True)
            refined.stop()
        embedded.stop()
    finally:
        vllm.stop()
        if vllm.proc is not None and vllm.proc.returncode not in (None, 0, -15):
            print((home / "vllm.log").read_text()[-3000:])
        shutil.rmtree(home, ignore_errors=True)
    n = len(out["cases"])
    out["agreement"] = {"n": n, "vllm": sum(c["vllm"] == c["reference"] for c in out["cases"]),
                        "embedded": sum(c["embedded"] == c["reference"] for c in out["cases"]),
                        "vllm_text": sum(c["vllm_text"] == c["reference_text"] for c in out["cases"]),
                        "embedded_text": sum(c["embedded_text"] == c["reference_text"] for c in out["cases"])}
    out["refined_identical"] = sum(r["identical"] for r in out["refined"])
    out["refined_identical_to_repeat"] = sum(r["identical_to_repeat"] for r in out["refined"])
    out["alone_repeat_identical"] = sum(r["alone_repeat_identical"] for r in out["refined"])
    out["elapsed_s"] = time.perf_counter() - t0
    write_json(args.json, out)
    a = out["agreement"]
    print(f"first-token top-1 agreement with vLLM's full prefill over {n} cases: skillcache on vLLM {a['vllm']}/{n}, "
          f"embedded {a['embedded']}/{n}; greedy-{args.case_tokens} texts identical: on vLLM {a['vllm_text']}/{n}, "
          f"embedded {a['embedded_text']}/{n}; refined heads greedy-{args.greedy_tokens} identical "
          f"{out['refined_identical']}/{len(out['refined'])} to vLLM alone's cold prompt, "
          f"{out['refined_identical_to_repeat']}/{len(out['refined'])} to vLLM alone's repeat of it (vLLM alone's "
          f"repeat to its own cold prompt {out['alone_repeat_identical']}/{len(out['refined'])})")


if __name__ == "__main__":
    main()
