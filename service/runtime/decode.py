"""Token-by-token decoding: greedy or sampled (temperature, top_p, seed), stop strings, streaming."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from service.runtime.engine import ModelRuntime, PrefillResult
from service.runtime.params import Delta, Done, GenParams


def sample_token(logits: torch.Tensor, p: GenParams, gen: torch.Generator | None) -> int:
    """logits: [V] float32 -> token id."""
    if p.temperature <= 0:
        return int(torch.argmax(logits))
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


def top_logprobs(rt: ModelRuntime, logits: torch.Tensor, k: int) -> list[tuple[str, float]]:
    lp = torch.log_softmax(logits, dim=-1)
    vals, ids = torch.topk(lp, k)
    return [(rt.tokenizer.decode([int(i)]), float(v)) for v, i in zip(vals, ids)]


def generate(
    rt: ModelRuntime, pre: PrefillResult, p: GenParams, cancelled: Callable[[], bool] = lambda: False
) -> Iterator[Delta | Done]:
    """Decode from a prefilled cache. Yields text deltas, then one Done.

    Text that could still be the start of a stop string, or an incomplete UTF-8 sequence, is held
    back until it is resolved, so a stop string never leaks into the stream.
    """
    gen = None
    if p.temperature > 0:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(p.seed if p.seed is not None else torch.seed())
    logits, pos, ids = pre.logits.cpu(), pre.n_prompt, []
    first_top = top_logprobs(rt, logits, p.logprobs) if p.logprobs else None
    emitted, holdback = 0, max((len(s) for s in p.stop), default=1) - 1
    reason = "length"
    with torch.inference_mode():
        while len(ids) < p.max_tokens:
            if cancelled():
                reason = "cancelled"
                break
            tok = sample_token(logits, p, gen)
            if tok in rt.eos_ids:
                reason = "stop"
                break
            ids.append(tok)
            text = rt.tokenizer.decode(ids, skip_special_tokens=True)
            cut = min((i for i in (text.find(s, max(0, emitted - holdback)) for s in p.stop if s) if i >= 0), default=-1)
            if cut >= 0:
                if cut > emitted:
                    yield Delta(text[emitted:cut])
                emitted, reason = cut, "stop"
                text = text[:cut]
                break
            safe = len(text) - holdback
            if text.endswith("\ufffd"):
                safe = min(safe, len(text.rstrip("\ufffd")))
            if safe > emitted:
                yield Delta(text[emitted:safe])
                emitted = safe
            if len(ids) >= p.max_tokens:
                break
            logits = rt.forward([tok], pos, pre.cache).cpu()
            pos += 1
    text = rt.tokenizer.decode(ids, skip_special_tokens=True)
    if reason == "stop" and p.stop:
        cuts = [i for i in (text.find(s) for s in p.stop if s) if i >= 0]
        text = text[: min(cuts)] if cuts else text
    if len(text) > emitted:
        yield Delta(text[emitted:])
    yield Done(reason, text, ids, first_top)
