"""Model fingerprint: changes when weights, tokenizer, chat templates, any compute field of the config (RoPE
included) or dtype change.

Weight files are hashed once and the digest cached by (path, size, mtime), so a multi-GB
checkpoint does not re-hash at every start. Models without files (random-weight test models)
hash their state dict directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from service.kv.layout import LAYOUT_VERSION

log = logging.getLogger(__name__)
_CHUNK = 8 * 1024 * 1024


def file_digest(path: Path, cache_file: Path | None) -> str:
    """sha256 of a file's bytes, remembered in `cache_file` by (resolved path, size, mtime): a file is read once
    per change (weights for the fingerprint, GGUF files for their conversion's name)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache: dict[str, str] = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
    if ident in cache:
        return cache[ident]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if cache_file is not None:
        cache[ident] = digest
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".fp-")
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, cache_file)
        except OSError as e:  # a cache we cannot write only costs a re-hash next start
            log.warning("cannot write fingerprint cache %s: %s", cache_file, e)
    return digest


def weights_digest(model: PreTrainedModel, source_files: list[Path], cache_file: Path | None) -> str:
    h = hashlib.sha256()
    if source_files:
        for p in source_files:
            h.update(p.name.encode())
            h.update(file_digest(p, cache_file).encode())
    else:
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def tokenizer_digest(tok: PreTrainedTokenizerBase) -> str:
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)).encode())
    template = getattr(tok, "chat_template", None) or ""  # a dict when the tokenizer ships named templates
    h.update((template if isinstance(template, str) else json.dumps(template, sort_keys=True)).encode())
    h.update(json.dumps(tok.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


_NOT_COMPUTE = {"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
                "output_attentions", "output_hidden_states", "return_dict", "_commit_hash", "quantization_config"}


def model_fingerprint(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    source_files: list[Path],
    dtype: torch.dtype,
    cache_file: Path | None = None,
    quantization: str = "none",
) -> str:
    """A short stable id: sha256 over weights, tokenizer + templates, the text config, dtype, layout."""
    # the whole text config: any field can change the K/V (rms_norm_eps, layer_types, no_rope_layers,
    # query_pre_attn_scalar...); only bookkeeping that does not is left out
    cfg = {k: v for k, v in model.config.get_text_config(decoder=True).to_dict().items()
           if k not in _NOT_COMPUTE and not k.startswith("_")}
    parts = {
        "weights": weights_digest(model, source_files, cache_file),
        "tokenizer": tokenizer_digest(tok),
        "config": cfg,
        "dtype": str(dtype),
        "layout": LAYOUT_VERSION,
    }
    if quantization != "none":  # absent for unquantized models: their fingerprints stay what they were
        parts["quantization"] = quantization
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
