"""Tiny GGUF files for fast tests: a 2-layer, 64-wide llama with random float32 weights and the tiny BPE
tokenizer of tests/tiny.py written as GGUF tokenizer fields (about 0.5 MB; converts in a second or two).

`chat_template=True` writes tiny.py's ChatML template, False none (a base checkpoint, as llama.cpp exports
many), a string that template. `architecture` other than llama writes a file transformers cannot read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny import CHATML, tiny_tokenizer

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def _tokenizer_fields(w) -> int:
    """Write tiny_tokenizer() as a byte-level BPE ("gpt2") GGUF vocabulary; returns the vocab size."""
    tok = tiny_tokenizer()
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    specials = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok.bos_token])
    w.add_eos_token_id(vocab[tok.eos_token])
    w.add_unk_token_id(vocab[tok.unk_token])
    w.add_pad_token_id(vocab[tok.pad_token])
    w.add_add_bos_token(False)
    return len(tokens)


def write_tiny_gguf(path: Path, seed: int = 0, chat_template: bool | str = True, architecture: str = "llama") -> Path:
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), architecture)
    w.add_name(f"tiny-{architecture}-{seed}")
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    vocab = _tokenizer_fields(w)
    w.add_vocab_size(vocab)
    if chat_template:
        w.add_chat_template(CHATML if chat_template is True else chat_template)

    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.1) -> None:  # numpy [out, in], as transformers' weights
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", vocab, HIDDEN, scale=1.0)
    kv = KV_HEADS * HIDDEN // HEADS
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, rows, cols in [("attn_q", HIDDEN, HIDDEN), ("attn_k", kv, HIDDEN), ("attn_v", kv, HIDDEN),
                                 ("attn_output", HIDDEN, HIDDEN), ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN),
                                 ("ffn_down", HIDDEN, FFN)]:
            t(f"blk.{i}.{name}.weight", rows, cols)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
