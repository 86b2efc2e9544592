"""Model-family discovery for re-rotation: which rotary module(s), per layer, which cached dims rotate.

`build_rotator(model)` inspects a loaded transformers 5.24 model and returns the KeyRotator that
moves its cached KV (the tensor math lives in service.kv.rope). Families:
- rope:        one `rotary_emb` shared by every layer (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE,
               Phi partial rotary, Gemma-2, ...); sliding-window layers need nothing more here, the
               cache keeps every token (service.kv.cache.new_cache) and the model's mask enforces the window.
- per-layer:   Gemma-3: one rotary module with per-layer-type buffers (`sliding_attention_inv_freq`,
               `full_attention_inv_freq`) and `forward(x, position_ids, layer_type)`.
- mla:         DeepSeek-V2/V3: transformers caches the compressed latent, keys = kv_a_layernorm(latent)
               [1, 1, T, kv_lora_rank] (position-free), values = k_pe [1, 1, T, qk_rope_head_dim] (post-RoPE).
               Only the value slot rotates. V3 with `rope_interleave` rotates interleaved pairs but writes
               them de-interleaved (half-split), so the cached k_pe is re-rotated with rotate_half; V2 keeps
               the interleaved layout (complex multiply) and is re-rotated with its own `apply_rotary_emb`.
- mrope:       Qwen2-VL / Qwen2.5-VL: 3-D (temporal, height, width) positions; a text block shifts all three
               by the same delta. Blocks holding image/video tokens are refused (UnsupportedModel).
- NoPE layers: SmolLM3 (`no_rope_layers`), Cohere-2 (global layers): their keys are copied, not rotated.
Anything else without a standard rotary embedding, or whose cache is not per-token KV, raises
UnsupportedModel (the API maps it to 422).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from service.errors import UnsupportedModel
from service.kv.rope import NO_ROPE, KeyRotator

PER_TOKEN_LAYER_TYPES = {"full_attention", "sliding_attention"}
REFUSED_MODEL_TYPES = {
    "llama4": "chunked attention with interleaved NoPE layers and complex RoPE is not adapted yet",
    "gemma3n": "layers share KV caches across depth (KV sharing)",
    "gemma4": "layers share KV caches across depth (KV sharing)",
}


class LayerTypeRotary(nn.Module):
    """One layer type's view of a per-layer-type rotary module (Gemma-3): the KeyRotator's rotary interface."""

    def __init__(self, rotary: nn.Module, layer_type: str) -> None:
        super().__init__()
        self.rotary, self.layer_type = rotary, layer_type
        self.rope_type = rotary.rope_type[layer_type]
        self.attention_scaling = float(getattr(rotary, f"{layer_type}_attention_scaling"))
        self.original_max_seq_len = getattr(rotary, "original_max_seq_len", None)

    @property
    def inv_freq(self) -> torch.Tensor:  # [R/2]
        return getattr(self.rotary, f"{self.layer_type}_inv_freq")

    def forward(self, x, position_ids):
        return self.rotary(x, position_ids, self.layer_type)  # cos, sin: [B, T, R]


class _WrappedRotary(nn.Module):
    """A model's rotary module behind the KeyRotator's interface (rope_type, attention_scaling, inv_freq)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary
        self.rope_type = rotary.rope_type
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.original_max_seq_len = getattr(rotary, "original_max_seq_len", None)

    @property
    def inv_freq(self) -> torch.Tensor:  # [R/2]
        return self.rotary.inv_freq


class MRopeRotary(_WrappedRotary):
    """M-RoPE for text: the same position on the temporal, height and width axes ([3, B, T])."""

    def forward(self, x, position_ids):  # position_ids [B, T]
        return self.rotary(x, position_ids[None].expand(3, -1, -1))  # cos, sin: [B, T, R]


class ComplexRotary(_WrappedRotary):
    """DeepSeek-V2's rotary returns freqs_cis [B, T, R/2] (complex); expose it as cos/sin [B, T, R]."""

    def forward(self, x, position_ids):
        f = self.rotary(x, position_ids)  # [B, T, R/2] complex, scaled by attention_scaling
        return torch.cat([f.real, f.real], -1), torch.cat([f.imag, f.imag], -1)


def _complex_apply(apply_rotary_emb):
    """The model's interleaved-pair (complex) apply, called with cos/sin in the ComplexRotary layout."""

    def apply(q, k, cos, sin):
        half = cos.shape[-1] // 2
        freqs_cis = torch.complex(cos[..., :half].float(), sin[..., :half].float())  # [1, T, R/2]
        return apply_rotary_emb(q, k, freqs_cis)

    return apply


def _module_fn(obj, name: str):
    fn = getattr(sys.modules[type(obj).__module__], name, None)
    if fn is None:
        raise UnsupportedModel(f"{type(obj).__module__} has no {name}; cannot re-rotate its keys")
    return fn


def _check_cache_layers(cfg) -> list[str]:
    """The text config's cache layer types; refuse anything that is not per-token KV."""
    layer_types, _ = get_layer_types_and_kwargs(cfg)
    odd = sorted(set(layer_types) - PER_TOKEN_LAYER_TYPES)
    if odd:
        raise UnsupportedModel(
            f"{cfg.model_type}: cache layer types {odd} hold no per-token KV (or a chunked one); "
            "precompiled blocks need full per-token keys and values"
        )
    return list(layer_types)


def _nope_layers(cfg, n_layers: int) -> set[int]:
    """Layers that apply no RoPE to their keys."""
    if cfg.model_type == "smollm3":
        return {i for i, use in enumerate(cfg.no_rope_layers) if not use}
    if cfg.model_type == "cohere2":
        return {i for i, t in enumerate(cfg.layer_types) if t != "sliding_attention"}
    return set()


def build_rotator(model) -> KeyRotator:
    """The KeyRotator for `model`, or UnsupportedModel with the reason."""
    cfg = model.config.get_text_config(decoder=True)
    for mt in {model.config.model_type, cfg.model_type}:
        if mt in REFUSED_MODEL_TYPES:
            raise UnsupportedModel(f"{mt}: {REFUSED_MODEL_TYPES[mt]}")
    n_layers = int(cfg.num_hidden_layers)
    layer_types = _check_cache_layers(cfg)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModel(f"{type(model).__name__} has no rotary embedding; re-rotation needs RoPE")
    rope = getattr(cfg, "rope_parameters", None) or {}
    original_max = rope.get("original_max_position_embeddings")  # None for per-layer-type dicts
    kw: dict = {}
    apply = None
    if isinstance(getattr(rotary, "rope_type", None), dict):  # Gemma-3: per-layer-type buffers
        kinds = sorted(rotary.rope_type)
        rotaries: list[nn.Module] = [LayerTypeRotary(rotary, k) for k in kinds]
        layer_rope = [kinds.index(t) if t in kinds else NO_ROPE for t in layer_types]
    elif hasattr(rotary, "inv_freq"):
        rotaries, layer_rope = [rotary], [0] * n_layers
        if hasattr(rotary, "mrope_section"):  # Qwen2-VL / Qwen2.5-VL
            if 2 * sum(rotary.mrope_section) != 2 * rotary.inv_freq.numel():
                raise UnsupportedModel(f"mrope_section {rotary.mrope_section} does not cover the rotary dims")
            rotaries = [MRopeRotary(rotary)]
            kw["refused_tokens"] = {
                int(t): name for name in ("image_token_id", "video_token_id")
                if (t := getattr(model.config, name, None)) is not None
            }
    else:
        raise UnsupportedModel(f"{type(rotary).__name__} exposes no inv_freq; re-rotation needs standard RoPE")
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):  # MLA
        kw["slot"] = "values"
        if 2 * rotaries[0].inv_freq.numel() != cfg.qk_rope_head_dim:
            raise UnsupportedModel("MLA rotary dims differ from qk_rope_head_dim")
        with torch.no_grad():
            dev = rotaries[0].inv_freq.device
            probe = rotary(torch.zeros(1, device=dev), torch.zeros(1, 1, dtype=torch.long, device=dev))
        if torch.is_tensor(probe) and probe.is_complex():  # DeepSeek-V2: interleaved pairs, kept interleaved
            rotaries = [ComplexRotary(rotary)]
            apply = _complex_apply(_module_fn(decoder, "apply_rotary_emb"))
        # DeepSeek-V3: k_pe is cached de-interleaved even with rope_interleave -> rotate_half apply
    for layer in _nope_layers(cfg, n_layers):
        layer_rope[layer] = NO_ROPE
    apply = apply or _module_fn(decoder, "apply_rotary_pos_emb")
    return KeyRotator(rotaries, layer_rope, apply, original_max_positions=original_max, **kw)


def model_class_for(config):
    """The Auto class that builds a text-generating model for `config` (VLMs: image-text-to-text)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES \
            and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def rotator_for_config(config) -> KeyRotator:
    """The KeyRotator of the model `config` describes, without its weights: the model is built on the meta device and
    only its rotary module is made for real (a process that runs the model elsewhere, such as vLLM's connector)."""
    with torch.device("meta"):
        model = model_class_for(config).from_config(config)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModel(f"{type(model).__name__} has no rotary embedding; re-rotation needs RoPE")
    with torch.device("cpu"):
        decoder.rotary_emb = type(rotary)(config.get_text_config(decoder=True))
    return build_rotator(model)
