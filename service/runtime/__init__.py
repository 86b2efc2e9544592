"""The only stage that touches the model: loading, fingerprint, prompts, prefill, decoding. build_runtime loads the
weights (the embedded engine); build_spec reads the rest only (the vLLM engine: vLLM runs the model)."""

from __future__ import annotations

import logging
from contextlib import nullcontext

from service.config import Settings

log = logging.getLogger(__name__)


def build_spec(settings: Settings, dtype: str, phase=None):
    """The vLLM engine's model: a ModelSpec (tokenizer, prompts, config, RoPE, fingerprint) with no weights read;
    vLLM runs the model. Its fingerprint hashes the weight files and names `dtype`, the one vLLM runs in."""
    phase = phase or (lambda name: nullcontext())
    import torch

    from service.runtime.adapters import rotator_for_config
    from service.runtime.fingerprint import model_fingerprint
    from service.runtime.loader import load_headless
    from service.runtime.spec import ModelSpec
    from service.runtime.templates import use_chat_template

    digests = settings.home / "fingerprints.json"
    with phase("reading the model's tokenizer and config (vLLM runs the model)"):
        loaded = load_headless(settings.model, settings.models_dir, getattr(torch, dtype), digests)
    loaded.chat_template = use_chat_template(loaded, settings.chat_template)
    fp = model_fingerprint(loaded.model, loaded.tokenizer, loaded.source_files, loaded.dtype, digests)
    return ModelSpec(loaded, fp, rotator_for_config(loaded.model.config))


def build_runtime(settings: Settings, phase=None):
    """Load the configured model and return a ModelRuntime with its fingerprint. The service calls it on the serving
    engine's thread, which owns torch's threads (service/runtime/threads.py) and then runs every forward. `phase`:
    service/phases.py's Phases (a context per start-up phase), or None."""
    phase = phase or (lambda name: nullcontext())
    from service.runtime.model import ModelRuntime
    from service.runtime.fingerprint import model_fingerprint
    from service.runtime.loader import load_model
    from service.runtime.templates import use_chat_template

    if settings.quantization == "w8a8":  # before loading anything: the format cannot run at speed on some CPUs
        from service.runtime.quantize import w8a8_unfit

        if why := w8a8_unfit():
            raise RuntimeError(why)
    if settings.quantization == "int8" or settings.dtype == "bfloat16":  # both multiply in bfloat16
        from service.runtime.loader import resolve_device
        from service.runtime.quantize import bfloat16_slow

        if resolve_device(settings.device).type == "cpu" and (why := bfloat16_slow()):  # it runs: a warning
            what = "SKILLCACHE_QUANTIZATION=int8" if settings.quantization == "int8" else "SKILLCACHE_DTYPE=bfloat16"
            log.warning("%s: %s", what, why)
    digests = settings.home / "fingerprints.json"  # file hashes, shared by GGUF conversion and the fingerprint
    with phase("loading the model (a GGUF is converted once, on the first start)"):
        loaded = load_model(settings.model, settings.models_dir, settings.device, settings.dtype, digests)
    loaded.chat_template = use_chat_template(loaded, settings.chat_template)  # before the fingerprint: it hashes it
    if settings.quantization != "none":
        from service.runtime.quantize import quantize_linears

        quantize_linears(loaded.model, settings.quantization)
    elif settings.packed_decode:
        from service.runtime.packed import pack_linears

        with phase("kernels: loading the prebuilt ones, packing and checking the linears"):
            counts = pack_linears(loaded.model)
        if counts:
            from service.runtime import native

            log.info("packed decode: %s linears run decode steps on their blocks (kernels %s, %s path)", counts,
                     native.loaded, native.extension().isa())
    fp = model_fingerprint(loaded.model, loaded.tokenizer, loaded.source_files, loaded.dtype, digests,
                           quantization=settings.quantization)
    return ModelRuntime(loaded, fp, kernel_attention=settings.attention_kernel)
