"""llguidance or xgrammar for typed replies on the embedded engine: per-token cost and schema coverage.

    python bench/grammar_libs.py --json bench/out/grammar-libs.json     # xgrammar: pip install xgrammar (bench only)

On the embedded model's tokenizer (SmolLM2, 49,152 ids), in process:
  per token  each library masks the logits [V] for the next token of a fixed compact JSON answer, applies the mask
             and takes the token; microseconds per token (median of --repeats passes), beside the model's own
             decode step at batch 1 (greedy, the same process)
  compile    milliseconds to compile each schema (the 200 of tests/api/test_structured_schemas.py)
  coverage   of those 200 and of a list of JSON Schema features (if/then, patternProperties, oneOf, not, ...):
             which schemas each library compiles (refusing is fine: a 422 naming the keyword; accepting and
             ignoring a keyword is not)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import load_runtime, write_json

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("api", ".")]
from test_structured_schemas import generated  # noqa: E402

ANSWER = {"answer": "Send the broken item back within 30 days with the receipt; the refund goes to your card.",
          "steps": ["Open the order page", "Choose return", "Print the label"], "tone": "friendly"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "steps", "tone"],
          "properties": {"answer": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}},
                         "tone": {"enum": ["formal", "friendly"]}}}
FEATURES = {
    "if/then/else": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "not": {"not": {"type": "string"}},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"const": 1}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "minProperties": {"type": "object", "minProperties": 2},
    "format date-time": {"type": "string", "format": "date-time"},
    "format uri": {"type": "string", "format": "uri"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"k": {"type": "array",
                                                                           "items": {"$ref": "#/$defs/n"}}}}},
                       "$ref": "#/$defs/n"},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
}


class Llg:
    name = "llguidance"

    def __init__(self, rt, n_vocab: int) -> None:
        from service.runtime.grammar import Grammar, ll_tokenizer

        self.rt, self.n_vocab, self.Grammar = rt, n_vocab, Grammar
        ll_tokenizer(rt.tokenizer, rt.eos_ids, n_vocab)  # built once, as the service does

    def compile(self, schema: dict):
        import llguidance

        from service.runtime.params import JSON_LAYOUT

        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_LAYOUT)
        err = llguidance.LLMatcher.validate_grammar(g)
        if err:
            raise ValueError(err)
        return g

    def matcher(self, schema: dict):
        g = self.Grammar(self.rt.tokenizer, self.rt.eos_ids, json.dumps(schema), self.n_vocab)
        return lambda logits: g.constrain(logits), g.take


class Xgr:
    name = "xgrammar"

    def __init__(self, rt, n_vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(rt.tokenizer, vocab_size=n_vocab,
                                                  stop_token_ids=sorted(rt.eos_ids))
        self.compiler = xgr.GrammarCompiler(info)
        self.n_vocab = n_vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, schema: dict):
        xgr = self.xgr
        m = xgr.GrammarMatcher(self.compile(schema))
        mask = xgr.allocate_token_bitmask(1, self.n_vocab)

        def constrain(logits):
            out = logits.clone()
            m.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(out.view(1, -1), mask)
            return out

        def take(tok: int) -> None:
            assert m.accept_token(tok), tok

        return constrain, take


def per_token(lib, ids: list[int], n_vocab: int, repeats: int) -> float:
    """Microseconds per token: mask, apply, take, over the answer's tokens."""
    logits = torch.randn(n_vocab)
    runs = []
    for _ in range(repeats):
        constrain, take = lib.matcher(SCHEMA)
        t0 = time.perf_counter()
        for tok in ids:
            constrain(logits)
            take(tok)
        runs.append((time.perf_counter() - t0) / len(ids) * 1e6)
    return statistics.median(runs)


def decode_step_us(rt, n: int = 48) -> float:
    from service.runtime.decode import generate
    from service.runtime.params import GenParams
    from service.runtime.prompt import PromptPlan, Segment

    ids = rt.prompts.encode_content("How do I get a refund for an order that arrived broken? Explain.")
    pre = rt.prefill(PromptPlan([Segment("text", ids)]), [], mode="full")
    eos, rt.eos_ids = rt.eos_ids, set()  # n tokens whatever the model says
    try:
        t0 = time.perf_counter()
        out = list(generate(rt, pre, GenParams(max_tokens=n)))
        return (time.perf_counter() - t0) / len(out[-1].token_ids) * 1e6
    finally:
        rt.eos_ids = eos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rt = load_runtime("embedded")
    n_vocab = rt.model.config.vocab_size
    ids = rt.tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    libs = [Llg(rt, n_vocab)]
    try:
        libs.append(Xgr(rt, n_vocab))
    except ImportError:
        print("xgrammar not installed: llguidance only", flush=True)
    out: dict = {"tokens": len(ids), "n_vocab": n_vocab, "decode_step_us": decode_step_us(rt), "libs": {}}
    for lib in libs:
        row: dict = {"per_token_us": per_token(lib, ids, n_vocab, args.repeats)}
        compile_ms, refused = [], []
        for i in range(200):
            t0 = time.perf_counter()
            try:
                lib.compile(generated(i))
            except Exception as e:  # noqa: BLE001 - a refusal is a result here
                refused.append((i, str(e)[:120]))
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        row.update(compile_ms_median=statistics.median(compile_ms), compile_ms_max=max(compile_ms),
                   generated_compiled=200 - len(refused), generated_refused=refused[:5])
        feats = {}
        for name, schema in FEATURES.items():
            try:
                lib.compile(schema)
                feats[name] = "compiled"
            except Exception as e:  # noqa: BLE001
                feats[name] = f"refused: {str(e)[:100]}"
        row["features"] = feats
        out["libs"][lib.name] = row
        print(f"{lib.name}: {row['per_token_us']:.0f} us/token ({row['per_token_us'] / out['decode_step_us']:.1%} of "
              f"a {out['decode_step_us'] / 1e3:.1f} ms decode step), compile median {row['compile_ms_median']:.2f} "
              f"ms, generated {row['generated_compiled']}/200", flush=True)
        for name, what in feats.items():
            print(f"  {name}: {what}", flush=True)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
