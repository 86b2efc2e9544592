"""Constrained decoding on this process's engine: a request's reply kept to a JSON schema by llguidance.

Before each sampled token the grammar's mask of allowed tokens is applied to the logits (-inf elsewhere), then the
token sampled is fed to the grammar. The state is the request's TokenStream's (service/runtime/decode.py), so it
follows the sequence through chunked prefill, batching and preemption; the prompt (composed skills included) is not
touched. End-of-sequence is allowed only where the JSON is complete. Why llguidance: docs/API.md, "Structured
outputs"; the cost per token: bench/structured.py and bench/grammar_libs.py.
"""

from __future__ import annotations

import threading
import weakref

import llguidance
import llguidance.hf
import llguidance.torch as llt
import torch

from service.errors import InternalError
from service.runtime.params import JSON_LAYOUT

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF tokenizer -> {(eos, n_vocab): LLTokenizer}
_BUILDING = threading.Lock()


def ll_tokenizer(tokenizer, eos_ids: set[int], n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer, end-of-sequence ids and logits width: 4 s for
    SmolLM2's 49k ids on this CPU, so the embedded engine builds it off its model thread (`vocab_ready`) before a
    typed request's first token; built twice, never (a second caller waits for the first)."""
    with _BUILDING:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        key = (tuple(sorted(eos_ids)), n_vocab)
        if key not in per:
            per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=sorted(eos_ids))
        return per[key]


def vocab_ready(rt) -> None:
    """Build the model's llguidance tokenizer now (for a thread other than the model's)."""
    ll_tokenizer(rt.tokenizer, rt.eos_ids, rt.model.config.vocab_size)


def grammar_of(json_schema: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json_schema, overrides=JSON_LAYOUT)


class Grammar:
    """One request's grammar state."""

    def __init__(self, tokenizer, eos_ids: set[int], json_schema: str, n_vocab: int) -> None:
        self.m = llguidance.LLMatcher(ll_tokenizer(tokenizer, eos_ids, n_vocab), grammar_of(json_schema))
        if self.m.is_error():  # the API validated the schema: only a changed library gets here
            raise InternalError(f"the response schema does not compile: {self.m.get_error()}")
        self.mask = llt.allocate_token_bitmask(1, n_vocab)  # [1, ceil(V / 32)] int32

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] float32 -> a copy with every token the grammar does not allow next at -inf."""
        out = logits.clone()
        llt.fill_next_token_bitmask(self.m, self.mask, 0)
        llt.apply_token_bitmask_inplace(out.view(1, -1), self.mask)
        return out

    def take(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise InternalError(f"the grammar refused token {token}: {self.m.get_error()}")
