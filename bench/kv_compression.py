"""Stored KV size and composition fidelity: uncompressed vs int8 storage (Settings.kv_compression).

    python bench/kv_compression.py --json bench/out/kv_compression.json

On the embedded model, every shipped skill (skills/, fields at their defaults) is compiled, stored
through the real serializer (service.store.serde) and read back; then compositions of 1-3 skills
are compared with the token-identical full recompute (service.runtime.fidelity.compare: first-token
logit cosine, top-1 agreement, KL, greedy 32-token match), once per storage arm:
  none           - the block as computed (the reference arm)
  int8           - what SKILLCACHE_KV_COMPRESSION=int8 writes: keys per-channel, values per-token scales
  int8-k_token   - alternative: per-token scales for keys too
  int8-v_channel - alternative: per-channel scales for values too
Bytes per token: tensor bytes the store writes per token of a block, all layers (K + V + scales), and
the whole encoded payload (header and token ids included) per token. Each compressed arm also reports
its composed first-token logits against the uncompressed composition ("vs_none": cosine, KL, top-1),
which isolates what storage adds to the composition's own error.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import ROOT, write_json

SYSTEMS = ["You are a support agent for an online store.",
           "You are a careful assistant. Follow the policies below exactly. Be concise and polite always."]
USERS = ["My order arrived 10 days ago, unused. Can I get a refund? Answer APPROVE or DENY first.",
         "Which tool should you call to look up an order, and why?"]


def arms():
    from service.kv.quant import Int8Scheme

    return {"none": None, "int8": Int8Scheme("channel", "token"),
            "int8-k_token": Int8Scheme("token", "token"), "int8-v_channel": Int8Scheme("channel", "channel")}


def shipped_skills(rt):
    from service.registry.skill import render
    from skillcache_client.skillfile import iter_skill_files, parse_skill_file

    out = []
    for path in iter_skill_files(ROOT / "skills"):
        spec = parse_skill_file(path)
        text = render(spec["text"], spec.get("fields") or {})
        out.append((spec["name"], rt.prompts.encode_content(text)))
    return out


def cases(n: int) -> list[tuple[int, ...]]:
    singles = [(i,) for i in range(n)]
    pairs = [p for p in [(0, 1), (1, 0), (2, 4), (5, 3)] if max(p) < n]
    triples = [t for t in [(0, 1, 2), (2, 1, 0), (3, 5, 4), (4, 0, 5)] if max(t) < n]
    return singles + pairs + triples


def stored(rt, name: str, block, scheme):
    """(block as read back from the store, tensor bytes, payload bytes) for one arm."""
    from service.kv.block import LAYOUT_VERSION
    from service.kv.quant import stored_bytes
    from service.store.key import BlockKey
    from service.store.serde import decode_block, encode_block

    key = BlockKey(model_fingerprint=rt.fingerprint, layout_version=LAYOUT_VERSION, namespace="bench",
                   content_hash=name)
    if scheme is None:
        data, tensor_bytes = encode_block(key, block, "none"), stored_bytes(block, "none")
    else:
        data, tensor_bytes = encode_block(key, block, "int8", scheme), stored_bytes(block, "int8", scheme)
    return decode_block(data, key), tensor_bytes, len(data)


def logit_gap(a, b) -> dict:
    """a vs b, first-token logits [V]: cosine, KL(b || a), same top-1."""
    import torch

    a, b = a.float(), b.float()
    kl = torch.nn.functional.kl_div(torch.log_softmax(a, -1), torch.log_softmax(b, -1), log_target=True,
                                    reduction="sum")
    return {"cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)), "kl": max(float(kl), 0.0),
            "top1_agree": bool(a.argmax() == b.argmax())}


def summarize(rows: list[dict]) -> dict:
    cos = [r["cosine"] for r in rows]
    kl = [r["kl"] for r in rows]
    out = {"cases": len(rows), "cos_min": min(cos), "cos_median": statistics.median(cos),
           "top1": sum(r["top1_agree"] for r in rows) / len(rows), "kl_median": statistics.median(kl),
           "kl_max": max(kl), "greedy32": sum(bool(r["greedy_match"]) for r in rows) / len(rows)}
    if "vs_none" in rows[0]:
        gaps = [r["vs_none"] for r in rows]
        out["vs_none"] = {"cos_min": min(g["cosine"] for g in gaps), "kl_max": max(g["kl"] for g in gaps),
                          "top1": sum(g["top1_agree"] for g in gaps) / len(gaps)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--seam", type=int, default=None, help="seam tokens (default: Settings().seam_tokens)")
    ap.add_argument("--greedy", type=int, default=32)
    args = ap.parse_args()

    from service.config import Settings
    from service.runtime import build_runtime
    from service.runtime.fidelity import compare

    settings = Settings()
    seam = settings.seam_tokens if args.seam is None else args.seam
    t0 = time.perf_counter()
    rt = build_runtime(settings)
    print(f"model {rt.loaded.name} dtype={rt.loaded.dtype} loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    skills = shipped_skills(rt)
    compiled = {name: rt.compile_block(ids) for name, ids in skills}
    n_tok = sum(b.n_tokens for b in compiled.values())
    out = {"model": rt.loaded.name, "dtype": str(rt.loaded.dtype), "seam_tokens": seam, "n_greedy": args.greedy,
           "skills": {n: b.n_tokens for n, b in compiled.items()}, "arms": {}}
    for arm, scheme in arms().items():
        blocks, tensor_b, payload_b = {}, 0, 0
        for name, block in compiled.items():
            blocks[name], tb, pb = stored(rt, name, block, scheme)
            tensor_b, payload_b = tensor_b + tb, payload_b + pb
        rows = []
        for k, combo in enumerate(cases(len(skills))):
            names = [skills[i][0] for i in combo]
            msgs = [{"role": "system", "content": SYSTEMS[k % 2]}, {"role": "user", "content": USERS[k % 2]}]
            plan = rt.prompts.build(msgs, [blocks[n].token_ids for n in names])
            fid = compare(rt, plan, [blocks[n] for n in names], seam_tokens=seam, n_greedy=args.greedy)
            row = {"skills": names, **fid.to_dict()}
            if scheme is not None:  # this arm's composition vs the uncompressed one
                ref = rt.prefill(plan, [compiled[n] for n in names], mode="compose", seam_tokens=seam).logits
                got = rt.prefill(plan, [blocks[n] for n in names], mode="compose", seam_tokens=seam).logits
                row["vs_none"] = logit_gap(got, ref)
            rows.append(row)
        s = summarize(rows)
        out["arms"][arm] = {"tensor_bytes_per_token": tensor_b / n_tok, "payload_bytes_per_token": payload_b / n_tok,
                            "summary": s, "cases": rows}
        gap = s.get("vs_none")
        print(f"{arm:15s} {tensor_b / n_tok:8.0f} B/token (payload {payload_b / n_tok:8.0f}) "
              f"cos min={s['cos_min']:.5f} med={s['cos_median']:.5f} top1={s['top1']:.2f} "
              f"KL med={s['kl_median']:.2e} max={s['kl_max']:.2e} greedy32={s['greedy32']:.2f}"
              + (f" | vs none: cos min={gap['cos_min']:.6f} KL max={gap['kl_max']:.2e} top1={gap['top1']:.2f}"
                 if gap else ""), flush=True)
    ref = out["arms"]["none"]["tensor_bytes_per_token"]
    for arm in out["arms"].values():
        arm["ratio_vs_none"] = ref / arm["tensor_bytes_per_token"]
    write_json(args.json, out)


if __name__ == "__main__":
    main()
