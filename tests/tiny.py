"""Tiny random-weight models built from configs, and a small offline tokenizer with a chat template."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, PreTrainedTokenizerFast

from service.runtime.engine import ModelRuntime
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
}


def tiny_config(family: str, **overrides):
    model_type, extra = FAMILIES[family]
    return AutoConfig.for_model(model_type, **{**_BASE, **extra, **overrides})


@functools.lru_cache(maxsize=None)
def tiny_runtime(family: str, dtype: torch.dtype = torch.float32) -> ModelRuntime:
    cfg = tiny_config(family)
    cfg._attn_implementation = "eager" if family == "phi-partial" else "sdpa"
    loaded = build_random_model(cfg, tiny_tokenizer(), seed=0, dtype=dtype)
    fp = model_fingerprint(loaded.model, loaded.tokenizer, [], dtype)
    return ModelRuntime(loaded, fp)


def random_ids(n: int, seed: int = 0, vocab: int = 400) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
