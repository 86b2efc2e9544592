"""llama.cpp's `llama-server` as a peer for bench/peers.py: built once, served on loopback, streamed from.

The build uses the llama.cpp source vendored in the `llama-cpp-python` sdist on PyPI (pinned, so a rerun
measures the same llama.cpp), Release, only the `llama-server` target, no HTTPS/CURL, no web UI download,
native CPU flags. Source and build live in `.peers/` (git-ignored) and are never committed; a binary that is
there already is reused.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx

from service.devserver import ROOT, free_port

PEERS_DIR = ROOT / ".peers"
LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp of late 2025; bump it to measure a newer one
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF"]


def _run(cmd: list[str], log: Path, timeout_s: float, cwd: Path | None = None) -> None:
    """cmd in its own process group, which is killed whole (cmake's ninja and compilers too) on a timeout, an
    error or Ctrl-C."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{cmd[0]} failed ({rc}); log {log}:\n{tail}")


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON, jobs: int = 2, timeout_s: float = 3600,
                        peers_dir: Path = PEERS_DIR) -> tuple[Path, dict]:
    """The llama-server binary (built on first use) and its build record ({version, build_s, ...})."""
    build = peers_dir / "build"
    binary, info_path = build / "bin" / "llama-server", build / "peers-build.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if binary.is_file() and info.get("llama_cpp_python") == version:
        return binary, info
    if info:  # another version's build: cmake will not reconfigure a build folder for another source
        shutil.rmtree(build)
    peers_dir.mkdir(parents=True, exist_ok=True)
    log = peers_dir / "build.log"
    src_dir = peers_dir / "src"
    sdist = src_dir / f"llama_cpp_python-{version}.tar.gz"
    t0 = time.perf_counter()
    if not sdist.is_file():
        print(f"downloading the llama-cpp-python {version} sdist (llama.cpp source) ...", flush=True)
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={version}", "-d", str(src_dir)], log, 900)
    download_s = time.perf_counter() - t0
    tree = src_dir / f"llama_cpp_python-{version}"
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(src_dir, filter="data")
    source = tree / "vendor" / "llama.cpp"
    print(f"building llama-server from {source} (a few minutes on two cores; log {log}) ...", flush=True)
    t1, incremental = time.perf_counter(), binary.is_file()  # a build folder without a record: brought up to date
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS], log, 600)
    _run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], log, timeout_s)
    if not binary.is_file():
        raise SystemExit(f"the build finished without {binary}; log {log}")
    info = {"llama_cpp_python": version, "source": str(source), "cmake_flags": CMAKE_FLAGS, "jobs": jobs,
            "download_s": round(download_s, 1), "build_s": round(time.perf_counter() - t1, 1),
            "incremental": incremental, "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    info_path.write_text(json.dumps(info, indent=2))
    print(f"llama-server {'brought up to date' if incremental else 'built'} in {info['build_s']:.0f} s", flush=True)
    return binary, info


class LlamaServer:
    """`llama-server` on a free loopback port; stop() (or the with-block) always ends it."""

    def __init__(self, binary: Path, gguf: Path, log_path: Path, *, parallel: int, ctx: int, threads: int,
                 cache_reuse: int = 256, name: str = "llama-server") -> None:
        self.name, self.log_path = name, Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
                    "--cache-reuse", str(cache_reuse), "--no-webui"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LlamaServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"\n$ {' '.join(self.cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout_s: float = 120) -> dict:
        """Poll /health until 200; returns /props (build info, slots)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    props = httpx.get(f"{self.url}/props", timeout=5).json()
                    return {k: props.get(k) for k in ("build_info", "total_slots", "model_path")}
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name} not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def llama_one(client: httpx.AsyncClient, ids: list[int], n_predict: int, t_sched: float,
                    cache_prompt: bool = True, first_token: asyncio.Event | None = None) -> dict:
    """One streamed greedy /completion of a token-id prompt. Times from t_sched; the first token is the first
    chunk that carries a token. prompt_n: prompt tokens the server actually computed (the rest came from its
    cache), tokens_evaluated: the whole prompt as it saw it (must equal len(ids))."""
    body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 0, "stream": True,
            "cache_prompt": cache_prompt, "return_tokens": True}
    rec: dict = {"engine": "llama.cpp", "error": None, "ttft_s": None, "e2e_s": None, "text": "", "tokens": []}
    try:
        async with client.stream("POST", "/completion", json=body) as resp:
            if resp.status_code != 200:
                rec["error"] = f"http_{resp.status_code}: {(await resp.aread())[:300]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                now = time.perf_counter()
                if (ev.get("tokens") or ev.get("content")) and rec["ttft_s"] is None:
                    rec["ttft_s"] = now - t_sched
                rec["text"] += ev.get("content") or ""
                rec["tokens"] += ev.get("tokens") or []
                if ev.get("stop"):
                    t = ev.get("timings") or {}
                    rec.update(prompt_tokens=ev.get("tokens_evaluated"), completion_tokens=ev.get("tokens_predicted"),
                               prompt_n=t.get("prompt_n"), cache_n=t.get("cache_n"), stop_type=ev.get("stop_type"),
                               server_ms={"prompt": t.get("prompt_ms"), "predicted": t.get("predicted_ms")})
                    if rec["ttft_s"] is None:  # nothing generated (an end-of-generation token first)
                        rec["ttft_s"] = now - t_sched
                if first_token is not None and rec["ttft_s"] is not None:
                    first_token.set()
                if ev.get("stop"):
                    break
        rec["e2e_s"] = time.perf_counter() - t_sched
        if "completion_tokens" not in rec:
            rec["error"] = "no_final_chunk"
        elif rec["prompt_tokens"] != len(ids):
            rec["error"] = f"prompt_mismatch: sent {len(ids)} ids, the server evaluated {rec['prompt_tokens']}"
    except httpx.HTTPError as e:
        rec["error"] = type(e).__name__
    return rec
