"""Decoding: sampling (greedy or temperature / top_p / seed), a request's output stream, and an inline decoder.

`TokenStream` turns one request's sampled ids into text deltas and its final `Done`; the serving engine keeps one
per running sequence and `generate` (tests, benchmarks) drives one alone, so both emit the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from service.runtime.params import Delta, Done, GenParams

_WINDOW = 16  # tokens TokenStream re-decodes at most per new token (a partial UTF-8 sequence spans <= 4)


def sample_token(logits: torch.Tensor, p: GenParams, gen: torch.Generator | None) -> int:
    """logits: [V] float32 -> token id."""
    if p.temperature <= 0:
        return int(torch.argmax(logits))
    if 0 < p.top_k < logits.shape[-1]:  # the k-th largest logit and those above it stay (ties at it too)
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = torch.where(logits >= kth, logits, torch.full_like(logits, float("-inf")))
    # from the top logit down, and never divided by less than 1e-6: a temperature like 1e-40 overflowed to
    # inf/NaN (a 500); this close to 0, sampling is greedy up to exact ties anyway
    probs = torch.softmax((logits - logits.max()) / max(p.temperature, 1e-6), dim=-1)  # [V]
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p  # always keeps the first
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
        return int(idx[choice])
    return int(torch.multinomial(probs, 1, generator=gen))


def top_logprobs(tokenizer, logits: torch.Tensor, k: int) -> list[tuple[str, float]]:
    lp = torch.log_softmax(logits, dim=-1)
    vals, ids = torch.topk(lp, k)
    return [(tokenizer.decode([int(i)]), float(v)) for v, i in zip(vals, ids)]


class TokenStream:
    """One request's output. `push(token)` returns the text deltas it releases; `reason` is set once the request is
    finished (EOS, a stop string, max_tokens); `finish()` returns the remaining text and the Done.

    Text that could still be the start of a stop string, or an incomplete UTF-8 sequence, is held back until it is
    resolved, so a stop string never leaks into the stream.
    """

    def __init__(self, tokenizer, eos_ids: set[int], p: GenParams, first_logits: torch.Tensor | None = None) -> None:
        self.tok, self.eos_ids, self.p = tokenizer, eos_ids, p
        self.ids: list[int] = []
        self._fixed, self._offset = "", 0  # text of ids[:_offset], settled
        self.emitted = 0
        self.holdback = max((len(s) for s in p.stop), default=1) - 1
        self.reason: str | None = None
        self.gen: torch.Generator | None = None
        if p.temperature > 0:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(p.seed if p.seed is not None else torch.seed())
        self.first_top = top_logprobs(tokenizer, first_logits, p.logprobs) if p.logprobs and first_logits is not None \
            else None
        self.grammar = None  # p.json_schema: built at the first sample (it needs the logits' width)

    @property
    def greedy(self) -> bool:
        """The batch's argmax is this request's next token (no sampling, no grammar)."""
        return self.p.temperature <= 0 and self.p.json_schema is None

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] float32 -> the next token (within the grammar, if the request has one)."""
        if self.p.json_schema is None:
            return sample_token(logits, self.p, self.gen)
        if self.grammar is None:
            from service.runtime.grammar import Grammar

            self.grammar = Grammar(self.tok, self.eos_ids, self.p.json_schema, logits.shape[-1])
        tok = sample_token(self.grammar.constrain(logits), self.p, self.gen)
        self.grammar.take(tok)
        return tok

    def _text(self) -> str:
        """The text of self.ids, re-decoding only a window of the last tokens instead of the whole reply each token.
        The window's head is settled into `_fixed` only where decoding in two parts gives the same text as in one
        (byte-level BPE always; a tokenizer that drops a leading space at a cut just keeps decoding the window)."""
        window = self.tok.decode(self.ids[self._offset:], skip_special_tokens=True)
        text = self._fixed + window
        if len(self.ids) - self._offset > _WINDOW and not window.endswith("\ufffd"):
            cut = len(self.ids) - _WINDOW // 2
            head = self.tok.decode(self.ids[self._offset:cut], skip_special_tokens=True)
            if (not head.endswith("\ufffd")
                    and head + self.tok.decode(self.ids[cut:], skip_special_tokens=True) == window):
                self._fixed, self._offset = self._fixed + head, cut
        return text

    def push(self, tok: int) -> list[Delta]:
        if tok in self.eos_ids and (not self.p.ignore_eos or self.p.json_schema is not None):
            self.reason = "stop"
            return []
        self.ids.append(tok)
        text = self._text()
        out: list[Delta] = []
        cut = min((i for i in (text.find(s, max(0, self.emitted - self.holdback)) for s in self.p.stop if s)
                   if i >= 0), default=-1)
        if cut >= 0:
            if cut > self.emitted:
                out.append(Delta(text[self.emitted:cut]))
            self.emitted, self.reason = cut, "stop"
            return out
        safe = len(text) - self.holdback
        if text.endswith("\ufffd"):
            safe = min(safe, len(text.rstrip("\ufffd")))
        if safe > self.emitted:
            out.append(Delta(text[self.emitted:safe]))
            self.emitted = safe
        if len(self.ids) >= self.p.max_tokens:
            self.reason = "length"
        return out

    def finish(self, reason: str | None = None) -> list[Delta | Done]:
        """The rest of the text and the Done; `reason` (e.g. "cancelled") when the stream ended early."""
        reason = self.reason or reason or "length"
        text = self._fixed + self.tok.decode(self.ids[self._offset:], skip_special_tokens=True)
        if reason == "stop" and self.p.stop:
            cuts = [i for i in (text.find(s) for s in self.p.stop if s) if i >= 0]
            text = text[: min(cuts)] if cuts else text
        out: list[Delta | Done] = [Delta(text[self.emitted:])] if len(text) > self.emitted else []
        out.append(Done(reason, text, list(self.ids), self.first_top))
        return out


def generate(rt, pre, p: GenParams, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Delta | Done]:
    """Decode one request alone from its prefilled cache (`pre`: a PrefillResult), one forward per token. Yields text
    deltas, then one Done. The serving engine decodes in batches instead (service/runtime/serving)."""
    stream = TokenStream(rt.tokenizer, rt.eos_ids, p, pre.logits)
    logits, pos = pre.logits.cpu(), pre.n_prompt
    with torch.inference_mode():
        while True:
            if cancelled():
                yield from stream.finish("cancelled")
                return
            yield from stream.push(stream.sample(logits))
            if stream.reason is not None:
                break
            logits = rt.forward([stream.ids[-1]], pos, pre.cache).cpu()
            pos += 1
    yield from stream.finish()
