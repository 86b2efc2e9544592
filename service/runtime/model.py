"""ModelRuntime: the only place that runs the model. Compiles blocks, builds prompt caches, decodes."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from service.errors import InvalidRequest
from service.kv.block import KVBlock
from service.kv.cache import append_kv, block_from_cache, cache_bytes, new_cache, truncate
from service.kv.radix import HeadMatch
from service.runtime import attention
from service.runtime.adapters import build_rotator
from service.runtime.loader import LoadedModel
from service.runtime.prompt import PromptPlan
from service.runtime.spec import ModelSpec
from service.runtime.steps import BACKGROUND_CHUNK_TOKENS, DEFERRED_TAIL_TOKENS, Mode, PrefillResult, Steps, run_steps

class ModelRuntime(ModelSpec):
    holds_weights = True

    def __init__(self, loaded: LoadedModel, fingerprint: str, kernel_attention: bool = True) -> None:
        super().__init__(loaded, fingerprint, build_rotator(loaded.model))
        self.model = loaded.model
        self._anchor_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # L x [1, H_kv, A, D], lazily
        self._bytes_per_token: int | None = None
        # few-query forwards (decode steps, tails, seams) on service/runtime/attention.py where it fits the model
        # (SKILLCACHE_ATTENTION_KERNEL; off: the kernel is neither built nor checked)
        self.kernel_attention = kernel_attention and attention.usable(self.model)

    # ---- forward passes -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
        """Run ids at positions start.. onto cache (appending to it); return last logits [V] fp32."""
        input_ids = torch.tensor([ids], device=self.device)  # [1, T]
        pos = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)  # [1, T]
        with attention.kernel_attention(self.config, self.kernel_attention):
            out = self.model(input_ids=input_ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()  # [V]

    @torch.inference_mode()
    def continuation_logprob(self, first_logits: torch.Tensor, ids: list[int], start: int, cache: DynamicCache
                             ) -> float:
        """log p(ids | the cached context): `first_logits` [V] are the context's next-token logits, and ids[:-1] run
        at positions start.. onto the cache (appending to it; the caller truncates). Scores a forced choice."""
        lp = float(torch.log_softmax(first_logits.float(), dim=-1)[ids[0]])
        if len(ids) > 1:
            input_ids = torch.tensor([ids[:-1]], device=self.device)  # [1, T-1]
            pos = torch.arange(start, start + len(ids) - 1, device=self.device).unsqueeze(0)  # [1, T-1]
            out = self.model(input_ids=input_ids, position_ids=pos, cache=cache, use_cache=True)
            lps = torch.log_softmax(out.logits[0].float(), dim=-1)  # [T-1, V]
            lp += float(lps[torch.arange(len(ids) - 1), torch.tensor(ids[1:], device=lps.device)].sum())
        return lp

    @torch.inference_mode()
    def forward_steps(self, ids: list[int], start: int, cache: DynamicCache, chunk: int | None = None) -> Steps:
        """forward() in pieces of at most `chunk` tokens (None: one piece), a step each -> last logits [V].
        Chunking changes the result at float-rounding level only (docs/BENCHMARKS.md: KL ~3e-7)."""
        chunk = chunk or max(1, len(ids))
        logits = None
        for lo in range(0, len(ids), chunk):
            piece = ids[lo:lo + chunk]
            logits = self.forward(piece, start + lo, cache)
            yield len(piece)
        return logits

    @torch.inference_mode()
    def compile_block_steps(self, token_ids: list[int], anchor: list[int] | None = None,
                            chunk: int | None = None) -> Steps:
        """Prefill a skill's ids after `anchor` (default: the template's opening, self.anchor) -> KVBlock
        at positions len(anchor)..len(anchor)+N-1. `anchor=[]`: the ids alone at 0..N-1.

        The anchor is the text every prompt starts with before its first skill (`<|im_start|>system\n`
        on ChatML), so the first skill of a composed prompt is exactly what a full prefill computes
        (no rotation, no seam), and later skills see the same attention sink as in the full prompt.
        """
        if not token_ids:
            raise InvalidRequest("a skill must contain at least one token of text")
        anchor = self.anchor if anchor is None else anchor
        cache = new_cache(self.model.config, reserve_tokens=len(anchor) + len(token_ids))
        yield from self.forward_steps(list(anchor) + list(token_ids), 0, cache, chunk)
        block = block_from_cache(cache, token_ids, self.fingerprint, base=len(anchor))
        block.meta["dtype"] = str(block.dtype).removeprefix("torch.")
        return block

    def compile_block(self, token_ids: list[int], anchor: list[int] | None = None) -> KVBlock:
        return run_steps(self.compile_block_steps(token_ids, anchor))

    @torch.inference_mode()
    def append_anchor(self, cache: DynamicCache) -> None:
        """Append the anchor's K/V (computed once per runtime: it opens every prompt) to an empty cache."""
        if self._anchor_kv is None:
            tmp = new_cache(self.model.config)
            self.forward(self.anchor, 0, tmp)
            self._anchor_kv = [(layer.keys, layer.values) for layer in tmp.layers]
        append_kv(cache, [k for k, _ in self._anchor_kv], [v for _, v in self._anchor_kv])

    @torch.inference_mode()
    def full_prefill_steps(self, ids: list[int], chunk: int = BACKGROUND_CHUNK_TOKENS) -> Steps:
        """The full prefill of `ids` at 0..N-1 in steps of at most `chunk` tokens -> (cache, last logits [V])."""
        cache = new_cache(self.model.config, reserve_tokens=len(ids))
        logits = yield from self.forward_steps(ids, 0, cache, chunk)
        return cache, logits

    @torch.inference_mode()
    def exact_prefix_steps(self, ids: list[int], chunk: int = BACKGROUND_CHUNK_TOKENS,
                           held: KVBlock | None = None) -> Steps:
        """The full prefill of `ids` as a base-0 block: a refined prefix (service/compose/refine.py). `held`: an
        exact prefix of `ids` already refined; only the tokens after it are prefilled."""
        k = 0
        cache = new_cache(self.model.config, reserve_tokens=len(ids))
        if (held is not None and held.base == 0 and 0 < held.n_tokens < len(ids)
                and ids[:held.n_tokens] == held.token_ids):
            append_kv(cache, held.keys, held.values)
            k = held.n_tokens
        yield from self.forward_steps(ids[k:], k, cache, chunk)
        return block_from_cache(cache, ids, self.fingerprint, base=0)

    @torch.inference_mode()
    def extend_steps(self, cache: DynamicCache, cached_ids: list[int], ids: list[int], chunk: int | None = None
                     ) -> Steps:
        """A session turn: keep the cache's longest common prefix with `ids` (at least one token is recomputed: it
        gives the next-token logits), prefill the rest -> PrefillResult on the same cache."""
        t0 = time.perf_counter()
        lcp = next((i for i, (a, b) in enumerate(zip(cached_ids, ids)) if a != b), min(len(cached_ids), len(ids)))
        lcp = min(lcp, len(ids) - 1, cache.get_seq_length())
        truncate(cache, lcp)
        logits = yield from self.forward_steps(ids[lcp:], lcp, cache, chunk)
        ms = (time.perf_counter() - t0) * 1e3
        return PrefillResult(cache, logits, len(ids), lcp, len(ids) - lcp, {"prefill_ms": ms})

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take over every layer (measured: a one-token forward; MLA caches differ)."""
        if self._bytes_per_token is None:
            cache = new_cache(self.model.config)
            self.forward(self.anchor[:1] or [0], 0, cache)
            self._bytes_per_token = cache_bytes(cache)
        return self._bytes_per_token

    # ---- prompt cache ---------------------------------------------------------------------
    def prefill(self, plan: PromptPlan, blocks: list[KVBlock], mode: Mode = "compose",
                seam_tokens: int | list[int] = 4, prefix: KVBlock | None = None) -> PrefillResult:
        """prefill_steps run inline, each text run in one forward."""
        return run_steps(self.prefill_steps(plan, blocks, mode, seam_tokens, prefix))

    def prefill_steps(self, plan: PromptPlan, blocks: list[KVBlock], mode: Mode = "compose",
                      seam_tokens: int | list[int] = 4, prefix: KVBlock | HeadMatch | None = None,
                      chunk: int | None = None,
                      reserve_tokens: int = 0, defer_tail: bool = False, tail_limit: int = DEFERRED_TAIL_TOKENS
                      ) -> Steps:
        """The request's cache for `plan`, composed from `blocks` or prefilled in full, in steps (Composer.steps)."""
        from service.runtime.composer import Composer

        return Composer(self).steps(plan, blocks, mode, seam_tokens, prefix, chunk, reserve_tokens, defer_tail,
                                    tail_limit)
