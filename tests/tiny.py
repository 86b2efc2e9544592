"""Tiny random-weight models built from configs, and a small offline tokenizer with a chat template."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, PreTrainedTokenizerFast

from service.runtime.model import ModelRuntime
from service.runtime.fingerprint import model_fingerprint
from service.runtime.loader import build_random_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Refunds are allowed within 30 days of delivery when the item is unused.",
    "The assistant must check the order status before approving any request.",
    "Tool specs: search(query), lookup(order_id), refund(order_id, amount).",
    "Answer politely and briefly. Use the current value of every field.",
    "[STATE UPDATE] status has changed to shipped; this overrides any earlier value.",
] * 4


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML
    return fast


SLIDING_WINDOW = 16  # smaller than the tests' blocks, so composed prompts run past it
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1)
_BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, vocab_size=512, tie_word_embeddings=False,
)

# name -> (model_type, extra config)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("qwen3", {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "mistral": ("mistral", {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "phi-partial": ("phi", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "partial_rotary_factor": 0.5,
    }),
    "llama3-scaling": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
    }}),
    "yarn-scaling": ("qwen2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
    }}),
    # sliding window: alternating local/global layers (Gemma-2/3) or every layer (Mistral-style)
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": SLIDING_WINDOW, "layer_types": _ALTERNATING}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": SLIDING_WINDOW, "layer_types": _ALTERNATING,
                               "rope_parameters": {  # a local RoPE for sliding layers, a scaled global one
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}),
    "mistral-sliding": ("mistral", {"sliding_window": SLIDING_WINDOW,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # MLA: V3 (interleaved RoPE weights, yarn with mscale != mscale_all_dim) and V2 (complex RoPE)
    "deepseek_v3": ("deepseek_v3", {**_MLA, "rope_interleave": True, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0}}),
    "deepseek_v2": ("deepseek_v2", {**_MLA, "q_lora_rank": None,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # M-RoPE (text path of the VLM; mrope_section sums to head_dim / 2)
    "qwen2_vl": ("qwen2_vl", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "mrope_section": [2, 3, 3]}}),
    "qwen2_5_vl": ("qwen2_5_vl", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                      "mrope_section": [2, 3, 3]}}),
    # MoE
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # NoPE layers: SmolLM3 (every 2nd layer here) and Cohere-2 (global layers; local ones slide)
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0, 1], "pad_token_id": 2, "bos_token_id": 1, "eos_token_id": 2}),
    "cohere2": ("cohere2", {"sliding_window": SLIDING_WINDOW, "layer_types": _ALTERNATING}),
}
EAGER = {"phi-partial", "gemma2"}  # gemma2: logit soft-capping is an eager-attention feature
_VISION = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, spatial_merge_size=2, patch_size=4,
               temporal_patch_size=2, in_channels=3, out_hidden_size=64, intermediate_size=64)
_VLM = {"qwen2_vl": _VISION, "qwen2_5_vl": _VISION}  # keys one of the two vision configs does not use are ignored


def tiny_config(family: str, **overrides):
    model_type, extra = FAMILIES[family]
    kw = {**_BASE, **extra, **overrides}
    if model_type in _VLM:  # the text model's settings go in text_config; a one-block vision tower
        kw.update(bos_token_id=1, eos_token_id=2)
        return AutoConfig.for_model(model_type, text_config=kw, vision_config=_VLM[model_type], image_token_id=500,
                                    video_token_id=501, vision_start_token_id=502, tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **kw)


@functools.lru_cache(maxsize=None)
def tiny_runtime(family: str, dtype: torch.dtype = torch.float32, quantization: str = "none") -> ModelRuntime:
    """`quantization`: "int8" or "w8a8", the linear layers in a CPU weight format (service/runtime/quantize.py)."""
    cfg = tiny_config(family)
    cfg._attn_implementation = "eager" if family in EAGER else "sdpa"
    loaded = build_random_model(cfg, tiny_tokenizer(), seed=0, dtype=dtype)
    if quantization != "none":
        from service.runtime.quantize import quantize_linears

        quantize_linears(loaded.model, quantization)
    fp = model_fingerprint(loaded.model, loaded.tokenizer, [], dtype, quantization=quantization)
    return ModelRuntime(loaded, fp)


def tiny_spec(family: str = "llama"):
    """What the vLLM engine's process holds of the tiny model: a ModelSpec (no forward passes; the modules moved to
    the meta device), so a test that reaches for the weights in vLLM mode fails."""
    from service.runtime.adapters import rotator_for_config
    from service.runtime.spec import ModelSpec

    cfg = tiny_config(family)
    loaded = build_random_model(cfg, tiny_tokenizer(), seed=0)
    fp = model_fingerprint(loaded.model, loaded.tokenizer, [], loaded.dtype)
    loaded.model.to("meta")
    return ModelSpec(loaded, fp, rotator_for_config(cfg))


def random_ids(n: int, seed: int = 0, vocab: int = 400) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
