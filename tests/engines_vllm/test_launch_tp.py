"""service.vllm.launch with tensor parallelism: --tensor-parallel-size from VLLM_TP or --tp, and the ranks' cores
(a core list per rank where there are enough cores; nobind and one OpenMP thread per rank where there are not).
No vLLM is started here (bench/vllm_tp.py runs TP servers; docs/BENCHMARKS.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from service.vllm import launch
from service.vllm.launch import command, environment, tp_size


@pytest.fixture
def cores(monkeypatch):
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_TP"):
        monkeypatch.delenv(var, raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(launch.os, "cpu_count", lambda: n)

    set_cores(2)
    return set_cores


def tp_arg(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in cmd else None


def test_the_command_names_the_tp_size_above_one(tmp_path):
    assert tp_arg(command(tmp_path, 8100, tmp_path / "spans")) is None
    assert tp_arg(command(tmp_path, 8100, tmp_path / "spans", tp=1)) is None
    cmd = command(tmp_path, 8100, tmp_path / "spans", tp=3)
    assert tp_arg(cmd) == "3" and "--kv-transfer-config" in cmd


@pytest.mark.parametrize("n_cores, tp, bind, omp", [
    (2, 1, "0-1", None),
    (2, 2, "0-0|1-1", None),  # a core each
    (4, 2, "0-1|2-3", None),
    (8, 3, "0-1|2-3|4-5", None),
    (2, 3, "nobind", "1"),  # more ranks than cores: the OS schedules them, one thread each
])
def test_the_ranks_cores(cores, n_cores, tp, bind, omp):
    cores(n_cores)
    env = environment(tp=tp)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == bind
    assert env.get("OMP_NUM_THREADS") == omp


def test_cores_set_by_the_caller_are_kept(cores, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0")
    assert environment(tp=3)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|0"
    assert environment(cores="1", tp=3)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|0"


@pytest.mark.parametrize("raw, n", [("", 1), (" 3 ", 3), ("1", 1)])
def test_tp_size_reads_a_whole_number(raw, n):
    assert tp_size(raw) == n


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_tp_size_refuses_anything_else(raw):
    with pytest.raises(SystemExit):
        tp_size(raw)


@pytest.mark.parametrize("env_tp, argv, want", [(None, [], None), ("3", [], "3"), ("3", ["--tp", "2"], "2"),
                                                (None, ["--tp", "3"], "3"), ("1", [], None)])
def test_main_reads_vllm_tp_and_the_tp_option(cores, monkeypatch, tmp_path, env_tp, argv, want):
    if env_tp is not None:
        monkeypatch.setenv("VLLM_TP", env_tp)
    seen: dict = {}
    monkeypatch.setattr(launch, "model_dir", lambda settings: Path(tmp_path))
    monkeypatch.setattr(launch.os, "execve", lambda path, cmd, env: seen.update(cmd=cmd, env=env))
    monkeypatch.setattr(sys, "argv", ["launch", "--dtype", "float32", *argv])
    launch.main()
    assert tp_arg(seen["cmd"]) == want
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == {None: "0-1", "2": "0-0|1-1", "3": "nobind"}[want]
