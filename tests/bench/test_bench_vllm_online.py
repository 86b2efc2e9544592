"""bench/vllm_online.py (issue 42: errata keep vLLM's prefix cache aligned under load): its pure parts without
servers (Poisson schedule, statistics, vLLM's counters, the ratio tables), then the script itself at a tiny load on
the embedded engine (seconds), and on vLLM when its venv is installed (vLLM's start: about two minutes here)."""

import json
import os
import subprocess
import sys

import pytest

from embedded_model import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import vllm_online_work as W  # noqa: E402

METRICS = """# HELP vllm:prefix_cache_queries_total x
vllm:prefix_cache_queries_total{engine="0",model_name="skillcache"} 5000.0
vllm:prefix_cache_hits_total{engine="0",model_name="skillcache"} 4800.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="skillcache"} 200.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="skillcache"} 0.0
vllm:num_requests_running{engine="0",model_name="skillcache"} 2.0
vllm:num_requests_waiting{engine="0",model_name="skillcache"} 1.0
vllm:prefix_cache_hits_created{engine="0",model_name="skillcache"} 1.7e9
"""


def test_poisson_schedule_is_seeded_and_has_the_rate():
    a, b = W.poisson_schedule(5.0, 200.0, 1), W.poisson_schedule(5.0, 200.0, 1)
    assert a == b and a == sorted(a) and all(0 < t < 200 for t in a)
    assert 900 < len(a) < 1100  # 1000 expected
    assert W.poisson_schedule(5.0, 200.0, 2) != a and W.poisson_schedule(0.0, 10.0, 1) == []


def test_metrics_parse_and_hit_rate():
    m = W.parse_metrics(METRICS)
    assert (m["queries"], m["hits"], m["running"], m["waiting"]) == (5000, 4800, 2, 1)
    before = {**m, "queries": 1000.0, "hits": 800.0, "ext_queries": 0.0}
    h = W.hit_rates(before, m)
    assert h["queries"] == 4000 and h["hit_rate"] == pytest.approx(1.0) and h["ext_hit_rate"] == 0.0
    assert W.hit_rates(m, m)["hit_rate"] is None


def rec(ttft, e2e, off=0.0, error=None, waited=None):
    return {"ttft_s": ttft, "e2e_s": e2e, "t_offset": off, "error": error, "waited_s": waited}


def test_summary_counts_cut_requests_with_their_wait():
    recs = [rec(0.1 * i, 0.1 * i + 0.5, off=i) for i in range(1, 10)] + [rec(None, None, 9.5, "deadline", 30.0)]
    s = W.summarize(recs, rate=1.0, duration_s=10.0)
    assert (s["sent"], s["ok"], s["censored"], s["errors"]) == (10, 9, 1, {"deadline": 1})
    assert s["ttft_p50"] == pytest.approx(500) and s["ttft_p90"] == pytest.approx(900)
    assert s["ttft_p99"] == pytest.approx(30000)  # the cut request's wait, a lower bound
    assert s["completed_per_s"] == pytest.approx(9 / 10.4) and W.saturated(s)
    assert not W.saturated(W.summarize(recs[:9], 1.0, 10.0))
    assert W.percentile([], 50) is None and W.percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_ratio_and_behind_tables():
    fast = W.summarize([rec(0.05, 0.2, off=i) for i in range(10)], 1.0, 10.0)
    slow = W.summarize([rec(2.0, 2.5, off=i) for i in range(5)] + [rec(None, None, 9, "deadline", 11.0)], 1.0, 10.0)
    results = {"vllm/erratum": {"1": fast}, "vllm/in-place": {"1": slow}, "embedded/erratum": {"1": slow}}
    rows = W.ratios(results, [("vLLM alone", "vllm/erratum", "vllm/in-place"), ("x", "a", "b")])
    assert len(rows) == 1 and rows[0]["p90_inplace_over_erratum"] == pytest.approx(11000 / 50)
    assert rows[0]["throughput_erratum_over_inplace"] == pytest.approx((10 / 10.0) / (5 / 10.0))
    assert rows[0]["inplace_saturated"] and not rows[0]["erratum_saturated"]
    assert "| vLLM alone | 1.00 | 220.0x |" in W.ratio_table(rows)
    md = W.table(results, {"vllm/erratum": {"1": {"hit_rate": 0.985}}})
    assert "| vllm/erratum | 1.00 | 10 | 10 | 0 | 98.5% |" in md and "| vllm/in-place | 1.00 | 6 | 5 | 1 | - |" in md
    assert "| erratum | 1.00 | -x | 220.00x |" in W.behind_table(results)


def test_values_keep_the_token_layout():
    encode = lambda text: text.replace("(", " ( ").split()  # noqa: E731  one word, one token
    text_of = lambda v: f"Order status: {v}. Tier: standard."  # noqa: E731
    assert W.same_layout(encode, text_of, ["shipped", "out for delivery"]) == ["shipped"]
    vals = {W.value(i, ["a"]) for i in range(1, 10001)}
    assert len(vals) == 10000  # no conversation repeats another's value


def run_script(tmp_path, *args, timeout=900):
    out = tmp_path / "online.json"
    p = subprocess.run([sys.executable, "bench/vllm_online.py", "--duration-s", "2", "--min-arrivals", "0", "--drain-s",
                        "20", "--warmup", "1", "--settle-s", "10", "--threads", "1", "--policy-skills",
                        "refund-policy", "--json", str(out), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


@pytest.mark.slow
def test_script_runs_every_engine_at_a_tiny_load(tmp_path):
    """One vLLM server (skipped without its venv, failed under SKILLCACHE_REQUIRE_VLLM=1: then the embedded arms
    alone), then the embedded service; a one-skill policy, 2 s of arrivals at 2 req/s per arm."""
    sys.path.insert(0, str(ROOT / "tests" / "engines_vllm"))
    from vllm_env import REQUIRE_ENV
    from service.vllm.launch import VLLM_PYTHON

    arms = ["embedded/erratum", "embedded/in-place"]
    if VLLM_PYTHON.exists():
        arms = ["vllm/erratum", "vllm/in-place", "sc-vllm/erratum", "sc-vllm/in-place", *arms]
    elif os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{VLLM_PYTHON} missing and {REQUIRE_ENV}=1")
    out, stdout = run_script(tmp_path, "--block-size", "32", "--rates", "2", "--arms", *arms)
    for arm in arms:
        s = out["results"][arm]["2.0000"]
        assert not set(s["errors"]) - {"deadline"}, (arm, s)  # no prompt mismatch, no in_place fallback
    assert "| kind | rate (req/s) |" in stdout and "| engine | rate (req/s) |" in stdout
    if "vllm/erratum" in arms:
        for arm in arms[:4]:
            h = out["hits"][arm]["2.0000"]
            assert h["queries"] > 0 or out["results"][arm]["2.0000"]["sent"] == 0
        e = out["hits"]["vllm/erratum"]["2.0000"]  # the erratum keeps the policy a cached prefix: most tokens hit
        assert e["queries"] == 0 or e["hit_rate"] > 0.7, e
