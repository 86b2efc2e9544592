"""Start a vLLM server that loads skillcache's connector: one command line for `make run-vllm`, the tests and bench.

    python -m service.vllm.launch [--port P] [--python .venv-vllm/bin/python] [--spans-dir D] [--dtype auto]
                                  [--tp N]

serves the model skillcache is configured with (SKILLCACHE_MODEL; the embedded GGUF is converted once into the HF
folder vLLM reads) under the name `skillcache`, in the dtype vLLM runs fastest on this machine (fastest_dtype; one
setting overrides), with skillcache's connector and priority scheduling. `--tp N` (default: env VLLM_TP, else 1):
vLLM's tensor parallelism, N ranks as processes on the CPU build; each rank's connector saves and loads its own K/V
heads (environment() says how the ranks get cores).
vLLM runs in its own venv (scripts/install-vllm.sh); this module only builds its command and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def vllm_python(venv: Path | None = None) -> Path:
    """The python of vLLM's venv: SKILLCACHE_VLLM_VENV (default .venv-vllm), relative to the checkout."""
    if venv is None:
        from service.config import Settings

        venv = Settings().vllm_venv
    return (venv if venv.is_absolute() else ROOT / venv) / "bin" / "python"


VLLM_PYTHON = vllm_python()
SERVED_NAME = "skillcache"


def model_dir(settings) -> Path:
    """The HF folder of SKILLCACHE_MODEL: the embedded model or a .gguf converted once (as the service does)."""
    from service.runtime.gguf import convert_gguf
    from service.runtime.loader import gguf_source

    src = gguf_source(settings.model)
    if src is not None:
        return convert_gguf(src, settings.models_dir, settings.home / "fingerprints.json")
    path = Path(settings.model).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"vLLM serves a local HF folder or the embedded model here, not {settings.model!r}")
    return path


def connector_config(spans_dir: Path, redis_url: str | None = None) -> str:
    """kv_both: the connector loads spans into requests and saves the spans vLLM computes (service/vllm/connector.py);
    a load that fails is recomputed by vLLM, never served. redis_url: the shared tier behind the spans dir (replicas
    share their records through it: service/vllm/spans.py)."""
    extra: dict[str, str] = {"spans_dir": str(spans_dir)}
    if redis_url:
        extra["redis_url"] = redis_url
    return json.dumps({"kv_connector": "SkillcacheConnector", "kv_connector_module_path": "service.vllm.connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def fastest_dtype(flags: set[str] | None = None, gpu: bool | None = None) -> tuple[str, str]:
    """(dtype, why): the dtype vLLM runs fastest in on this machine. bfloat16 on a GPU and on CPUs with bfloat16
    instructions (AVX-512 BF16, AMX); float32 on other CPUs, where vLLM's bfloat16 ran 4-5x slower here."""
    if gpu if gpu is not None else _nvidia_gpu():
        return "bfloat16", "an NVIDIA GPU"
    flags = cpu_flags() if flags is None else flags
    have = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if have:
        return "bfloat16", f"the CPU has {' and '.join(have)}"
    return "float32", "the CPU has no bfloat16 instructions (avx512_bf16, amx_bf16)"


def _nvidia_gpu() -> bool:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.startswith("GPU ")


def resolve_dtype(setting: str) -> str:
    """SKILLCACHE_VLLM_DTYPE: auto picks fastest_dtype() and says why; anything else is used as set."""
    if setting != "auto":
        print(f"vLLM dtype {setting} (SKILLCACHE_VLLM_DTYPE)", file=sys.stderr)
        return setting
    dtype, why = fastest_dtype()
    print(f"vLLM dtype {dtype}: {why} (SKILLCACHE_VLLM_DTYPE=auto; set it to override)", file=sys.stderr)
    return dtype


def command(model: Path, port: int, spans_dir: Path | None, python: Path = VLLM_PYTHON, dtype: str = "float32",
            host: str = "127.0.0.1", extra: list[str] | None = None, redis_url: str | None = None,
            tp: int = 1) -> list[str]:
    """vLLM's OpenAI server; spans_dir None: vLLM alone (no connector), for the side-by-side benchmark. With the
    connector, priority scheduling: skillcache sends its background work (compiles ahead, checks) behind live
    requests."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           SERVED_NAME, "--host", host, "--port", str(port), "--dtype", dtype, "--enable-prompt-tokens-details",
           "--disable-uvicorn-access-log"]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if spans_dir is not None:
        cmd += ["--kv-transfer-config", connector_config(spans_dir, redis_url), "--scheduling-policy", "priority"]
    arch = causal_lm_architecture(model)
    if arch is not None:  # a folder converted before its config named one: vLLM would guess another head
        cmd += ["--hf-overrides", json.dumps({"architectures": [arch]})]
    return cmd + list(extra or [])


def causal_lm_architecture(model: Path) -> str | None:
    """The causal-LM class for a folder whose config.json names no `architectures` (None when it names some): vLLM
    otherwise picks by model_type alone, e.g. Gemma-3's text model as an embedding model."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("architectures"):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))


def environment(kv_cache_gib: int = 2, cores: str | None = None, tp: int = 1) -> dict[str, str]:
    """The connector imported from this checkout; vLLM's CPU KV space and cores (set ones are kept).

    vLLM's CPU build runs each tensor-parallel rank as a process with its own OpenMP threads, bound to one
    `|`-separated core list per rank (VLLM_CPU_OMP_THREADS_BIND; its `auto` wants a NUMA node per rank). TP > 1 with
    at least a core per rank: the cores split evenly. TP above the core count (TP 3 on 2 cores): no split gives every
    rank a core of its own, and ranks bound to the same core would each spin their threads on it, so `nobind` (the
    OS schedules the ranks) and one OpenMP thread per rank (OMP_NUM_THREADS=1: vLLM sets none under nobind, and
    each rank would start a thread per core)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    n = os.cpu_count() or 1
    if cores is None and tp > n:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    elif cores is None and tp > 1:
        per = n // tp
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(f"{r * per}-{(r + 1) * per - 1}" for r in range(tp)))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores or f"0-{max(0, n - 1)}")
    return env


def tp_size(setting: str | None = None) -> int:
    """VLLM_TP (or the given value): vLLM's tensor-parallel size, 1 when unset."""
    raw = os.environ.get("VLLM_TP", "") if setting is None else setting
    try:
        n = int(raw.strip() or 1)
    except ValueError:
        raise SystemExit(f"VLLM_TP must be a whole number of ranks, not {raw!r}") from None
    if n < 1:
        raise SystemExit(f"VLLM_TP must be at least 1, not {n}")
    return n


class VllmProcess:
    """A vLLM server as a subprocess, its output in `log`; stop() ends its whole process group."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.cmd, self.env, self.log = cmd, env, log
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "VllmProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not ready within {timeout_s:.0f} s; see {self.log}")

    def stop(self, sig: int = 15) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def main() -> None:
    from service.config import Settings

    ap = argparse.ArgumentParser(prog="python -m service.vllm.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--python", type=Path, default=VLLM_PYTHON)
    ap.add_argument("--spans-dir", type=Path, default=None, help="default: SKILLCACHE_VLLM_SPANS_DIR")
    ap.add_argument("--dtype", default=None, help="default: SKILLCACHE_VLLM_DTYPE (auto: the fastest here)")
    ap.add_argument("--print-model-dir", action="store_true", help="convert if needed, print the folder, exit")
    ap.add_argument("--tp", type=tp_size, default=None, help="vLLM's tensor-parallel size (default: VLLM_TP, else 1)")
    args, extra = ap.parse_known_args()
    tp = args.tp if args.tp is not None else tp_size()
    settings = Settings()
    model = model_dir(settings)
    if args.print_model_dir:
        print(model)
        return
    cmd = command(model, args.port, args.spans_dir or settings.vllm_spans_dir, args.python,
                  resolve_dtype(args.dtype or settings.vllm_dtype), extra=extra, redis_url=settings.vllm_spans_redis,
                  tp=tp)
    os.execve(cmd[0], cmd, environment(tp=tp))  # replaces this process: signals reach vLLM directly


if __name__ == "__main__":
    sys.exit(main())
