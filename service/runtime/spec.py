"""ModelSpec: what the service knows of a model without running it: tokenizer and prompts, config, limits, RoPE.

The vLLM engine's process holds only this (vLLM runs the model: SKILLCACHE_ENGINE=vllm never reads a weight);
ModelRuntime (service/runtime/model.py) is a ModelSpec with the weights and the forward passes.
"""

from __future__ import annotations

from service.errors import ContextTooLong
from service.kv.rope import KeyRotator
from service.runtime.loader import LoadedModel
from service.runtime.prompt import PromptBuilder


class ModelSpec:
    holds_weights = False  # True on ModelRuntime: this process runs the model

    def __init__(self, loaded: LoadedModel, fingerprint: str, rotator: KeyRotator) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.fingerprint = fingerprint
        self.device = loaded.device
        self.config = loaded.model.config.get_text_config(decoder=True)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 0) or 0) or None
        self.prompts = PromptBuilder(self.tokenizer)
        self.anchor = self.prompts.skill_anchor()  # what precedes the first skill in every prompt
        self.rotator = rotator  # family adapter; UnsupportedModel if none fits
        eos = loaded.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = set(eos)

    def check_length(self, n_prompt: int, max_new_tokens: int, mode: str) -> None:
        total = n_prompt + max_new_tokens
        if self.max_positions and total > self.max_positions:
            raise ContextTooLong(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.max_positions} tokens; use fewer or shorter skills or lower max_tokens"
            )
        if mode == "compose":
            self.rotator.check_positions(total - 1)
