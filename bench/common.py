"""Shared benchmark helpers: the runtime (embedded or a random-weight model from a config), timing."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Shapes of well-known checkpoints, for random-weight GPU runs (no hub access needed).
CONFIGS = {
    "llama-3.1-8b": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen3-8b": ("qwen3", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # the Llama-3.1-8B layout at toy size: bench/gpu/run.sh --dry-run checks the GPU script's path on CPU
    "llama-smoke": ("llama", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}


def load_runtime(model: str, device: str = "auto", dtype: str = "auto", chat_template: str | None = None,
                 packed: bool = False):
    """'embedded', a .gguf file, a HF id / local dir (`chat_template`: as SKILLCACHE_CHAT_TEMPLATE; `packed`: as
    SKILLCACHE_PACKED_DECODE), or one of CONFIGS (random weights, the embedded tokenizer: from the directory in
    SKILLCACHE_BENCH_TOKENIZER when set, as on a GPU machine without the GGUF)."""
    from service.config import Settings
    from service.runtime import build_runtime
    from service.runtime.model import ModelRuntime
    from service.runtime.loader import LoadedModel, resolve_device, resolve_dtype

    if model not in CONFIGS:
        return build_runtime(Settings(model=model, device=device, dtype=dtype, chat_template=chat_template,
                                      packed_decode=packed))
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.environ.get("SKILLCACHE_BENCH_TOKENIZER"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.environ["SKILLCACHE_BENCH_TOKENIZER"])
    else:
        tok = build_runtime(Settings(model="embedded", device="cpu")).tokenizer
    model_type, kw = CONFIGS[model]
    cfg = AutoConfig.for_model(model_type, **kw)
    dev, dt = resolve_device(device), resolve_dtype(dtype, resolve_device(device))
    torch.manual_seed(0)
    with torch.device(dev):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dt).eval()
    loaded = LoadedModel(m, tok, f"random-{model}", [], dev, dt)
    return ModelRuntime(loaded, f"random-{model}")  # hashing 8B random weights would only cost time


def sync(device) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device, repeats: int = 3, warmup: int = 1) -> tuple[float, object]:
    """Median wall time in ms over `repeats` runs (after `warmup`), and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def corpus_ids(rt, n: int) -> list[int]:
    """n token ids of real English text (the method digest and the shipped skills, repeated)."""
    body = "\n\n".join(p.read_text() for p in sorted((ROOT / "skills").glob("*.md")))
    ids = rt.prompts.encode_content(body)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))


async def sse_json(client, path: str, body: dict):
    """POST `body` to a streaming endpoint; yields each server-sent event's JSON object ([DONE] ends the stream)."""
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def stream_compose(client, body: dict) -> dict:
    """POST a streaming /v1/compose: the first-token time (first delta, or done when nothing was generated), the
    deltas' text and the done event, as the client sees them."""
    t0, ttft, done, parts = time.perf_counter(), None, None, []
    async for ev in sse_json(client, "/v1/compose", body):
        if ttft is None and ev["type"] in ("delta", "done"):
            ttft = time.perf_counter() - t0
        if ev["type"] == "delta":
            parts.append(ev["text"])
        elif ev["type"] == "done":
            done = ev
        elif ev["type"] == "error":
            raise RuntimeError(ev)
    return {"ttft_s": ttft, "text": "".join(parts), "done": done, "t_end": time.perf_counter()}


def kernel_of(rev: str, source: str, fn: str):
    """The C++ function `fn` of service/runtime/`source` as it was at commit `rev`, built here as a module of its own
    (bench/kernels.py and bench/attention.py --before: an earlier kernel beside this tree's, arms alternating)."""
    import subprocess
    import tempfile

    from torch.utils.cpp_extension import load

    src = subprocess.run(["git", "show", f"{rev}:service/runtime/{source}"], check=True, capture_output=True,
                         text=True).stdout
    src += (f"\n#include <torch/extension.h>\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {{\n  mod.def(\"{fn}\", "
            f"&{fn}, pybind11::call_guard<pybind11::gil_scoped_release>());\n}}\n")
    path = Path(tempfile.mkdtemp()) / source
    path.write_text(src)
    return load(f"skillcache_{fn}_before_{rev}", [str(path)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])

