"""The GPU benchmark's path (bench/ttft.py on a random-weight model from bench/common.CONFIGS), run on CPU
with the two-layer llama-smoke shape, so bench/gpu/run.sh does not rot between the tasks that get a GPU."""

import json
import os
import subprocess
import sys

import pytest

from embedded_model import ROOT

pytestmark = pytest.mark.slow  # needs the embedded model's tokenizer


def test_ttft_runs_every_arm_on_a_random_weight_config(tmp_path):
    out = tmp_path / "ttft.json"
    env = {**os.environ, "SKILLCACHE_BENCH_TOKENIZER": ""}  # the embedded model's own tokenizer
    subprocess.run([sys.executable, "bench/ttft.py", "--model", "llama-smoke", "--device", "cpu", "--lengths", "128",
                    "--seams", "4", "0", "--repeats", "1", "--json", str(out)], cwd=ROOT, env=env, check=True,
                   timeout=300, capture_output=True)
    row = json.loads(out.read_text())["rows"][0]
    assert row["skill_tokens"] == 128 and set(row["compose"]) == {"4", "0"}
    for arm in (row["compose"]["4"], row["refined"], row["first"]):
        assert arm["speedup_vs_full"] > 0 and arm["x_floor"] > 0


def test_fidelity_margin_part_runs_on_a_random_weight_config(tmp_path):
    """bench/fidelity.py part f (why greedy continuations part): a single skill is exact along the whole path, a
    moved second skill shifts the reference's logit gaps."""
    out = tmp_path / "fidelity.json"
    env = {**os.environ, "SKILLCACHE_BENCH_TOKENIZER": ""}
    subprocess.run([sys.executable, "bench/fidelity.py", "--model", "llama-smoke", "--device", "cpu", "--parts", "f",
                    "--cases", "0", "3", "--greedy", "4", "--json", str(out)], cwd=ROOT, env=env, check=True,
                   timeout=300, capture_output=True)
    single, pair = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "f"]
    assert single["n_skills"] == 1 and single["divergence"] is None and single["max_shift"] < 1e-3
    assert pair["n_skills"] == 2 and pair["max_shift"] > single["max_shift"]
    summary = json.loads(out.read_text())["summary"]["f_margins_by_n_skills"]
    assert [s["n_skills"] for s in summary] == [1, 2] and set(summary[1]["gate"]) == {"0.25", "0.5", "1.0", "2.0"}


def test_decode_bench_runs_both_arms_on_a_random_weight_config(tmp_path):
    """bench/decode.py (the GPU script's batching arms) on the two-layer llama-smoke shape, on CPU."""
    out = tmp_path / "decode.json"
    env = {**os.environ, "SKILLCACHE_BENCH_TOKENIZER": ""}
    subprocess.run([sys.executable, "bench/decode.py", "--model", "llama-smoke", "--device", "cpu", "--contexts", "64",
                    "--batch", "1", "2", "--steps", "2", "--warmup", "1", "--json", str(out)], cwd=ROOT, env=env,
                   check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arm"], r["batch"]) for r in rows] == [("dynamic", 1), ("batched", 1), ("batched", 2)]
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_gpu_head_assembly_script_checks_the_connectors_write_on_flash_attentions_layout(tmp_path):
    """bench/gpu/assemble_head.py (issue 49, the GPU item) on the two-layer llama-smoke shape, on CPU: the head written
    through service/vllm/paged.write_piece reads back as RoPE applied at the target positions."""
    out = tmp_path / "assemble.json"
    subprocess.run([sys.executable, "bench/gpu/assemble_head.py", "--model", "llama-smoke", "--tokens", "512",
                    "--device", "cpu", "--repeats", "1", "--json", str(out)], cwd=ROOT, check=True, timeout=300,
                   capture_output=True)
    r = json.loads(out.read_text())
    assert r["ok"] and r["n_head"] == 32 + 512 and r["write"].startswith("torch")
    assert all(c["values_equal"] and c["min_cosine"] > 0.999 for c in r["check"].values())
