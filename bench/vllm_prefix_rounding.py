"""vLLM alone against itself: how a prompt's greedy text depends on how its head got into vLLM's prefix cache.

    python bench/vllm_prefix_rounding.py --dtype bfloat16 --json bench/out/vllm-prefix-rounding-bf16.json [--cases 8]

The reference for skillcache's refined heads ("greedy-32 identical to vLLM alone") is vLLM's own full prefill; this
measures what vLLM alone gives when the same head comes from its prefix cache instead. One vLLM server (skillcache's
connector loaded, unused), the fidelity bench's cases (bench/fidelity_vllm.py: the shipped skills in orders of two
and three, a user turn). For each case, each arm under a fresh cache_salt, greedy --tokens tokens compared with the
cold prompt's:
  cold_repeat   the whole prompt again, cold (is vLLM deterministic at all)
  chunked       the head prefilled first in requests of --chunk new tokens (each hits the previous), then the prompt
  oneshot       the head prefilled first in one request, then the prompt (skillcache's refinement)
  earlier_turn  the same head with another user turn first, then the prompt (vLLM alone's own repeated orders)
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import tempfile
import uuid
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx
from fidelity_vllm import SHIPPED, TURNS
from peers_work import Prompts

from service.devserver import ROOT, free_port
from service.vllm.launch import SERVED_NAME, VllmProcess, command, environment, fastest_dtype, model_dir

ARMS = ("cold_repeat", "chunked", "oneshot", "earlier_turn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=fastest_dtype()[0])
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "vllm-prefix-rounding.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)  # the fidelity bench's orders, in its order
    orders = [o for k in (2, 3) for o in itertools.permutations(SHIPPED, k)]
    rng.shuffle(orders)
    cases = [(orders[i], TURNS[i % len(TURNS)]) for i in range(args.cases)]
    prompts = Prompts(SHIPPED)
    home = Path(tempfile.mkdtemp(prefix="skillcache-prefix-rounding-"))
    from service.config import Settings

    vllm = VllmProcess(command(model_dir(Settings(model="embedded")), free_port(), home / "spans", dtype=args.dtype),
                       environment(), home / "vllm.log")

    def gen(ids: list[int], n: int, salt: str) -> str:
        body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": n, "temperature": 0.0, "cache_salt": salt}
        r = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    out: dict = {"dtype": args.dtype, "chunk": args.chunk, "tokens": args.tokens, "cases": []}
    try:
        vllm.start().wait_ready(900)
        for order, user in cases:
            ids, other = prompts.ids(order, user), prompts.ids(order, "Hello.")
            h = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)  # the head: what both turns share
            cold = gen(ids, args.tokens, str(uuid.uuid4()))
            texts = {"cold_repeat": gen(ids, args.tokens, str(uuid.uuid4()))}
            salt = str(uuid.uuid4())
            for end in list(range(args.chunk, h, args.chunk)) + [h]:
                gen(ids[:end], 1, salt)
            texts["chunked"] = gen(ids, args.tokens, salt)
            salt = str(uuid.uuid4())
            gen(ids[:h], 1, salt)
            texts["oneshot"] = gen(ids, args.tokens, salt)
            salt = str(uuid.uuid4())
            gen(other, 8, salt)
            texts["earlier_turn"] = gen(ids, args.tokens, salt)
            case = {"order": list(order), "head": h, "n": len(ids), "cold": cold,
                    **{a: {"identical": texts[a] == cold, "text": texts[a]} for a in ARMS}}
            out["cases"].append(case)
            print(order, {a: case[a]["identical"] for a in ARMS}, flush=True)
    finally:
        vllm.stop()
        shutil.rmtree(home, ignore_errors=True)
    n = len(out["cases"])
    out["identical"] = {a: sum(c[a]["identical"] for c in out["cases"]) for a in ARMS}
    write_json(args.json, out)
    print(f"{args.dtype}: greedy-{args.tokens} identical to the cold prompt over {n} cases: "
          + ", ".join(f"{a} {k}/{n}" for a, k in out["identical"].items()))


if __name__ == "__main__":
    main()
