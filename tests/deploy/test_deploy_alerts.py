"""deploy/prometheus/alerts.yml: the required alerts exist, and every series and label they use is one that
service/metrics.py defines (read with ast, so a renamed metric breaks this test, not a silent alert)."""

from __future__ import annotations

import re
import subprocess

import pytest

from deploy_helpers import REPO, load_yaml, tool
from deploy_helpers import missing
from metric_names import METRICS, expr_problems

ALERTS_FILE = REPO / "deploy" / "prometheus" / "alerts.yml"
RULES = [r for g in load_yaml(ALERTS_FILE)["groups"] for r in g["rules"]]
BY_NAME = {r["alert"]: r for r in RULES}


def test_metrics_module_was_read():
    assert "skillcache_ttft_seconds_bucket" in METRICS
    assert "skillcache_requests_total" in METRICS
    assert METRICS["skillcache_store_up"] == ("Gauge", {"tier"})


@pytest.mark.parametrize("rule", RULES, ids=[r["alert"] for r in RULES])
def test_rule_shape(rule):
    assert re.fullmatch(r"Skillcache[A-Za-z0-9]+", rule["alert"])
    assert rule["expr"].strip()
    assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert rule["labels"]["severity"] in ("warning", "critical")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize("rule", RULES, ids=[r["alert"] for r in RULES])
def test_rule_uses_defined_series_and_labels(rule):
    assert expr_problems(rule["expr"]) == []


def test_required_alerts():
    ttft = BY_NAME["SkillcacheTTFTHigh"]["expr"]
    assert "histogram_quantile(0.95" in ttft and "skillcache_ttft_seconds_bucket" in ttft
    errors = BY_NAME["SkillcacheErrorRateHigh"]["expr"]
    assert "status=~\"5..\"" in errors and "skillcache_requests_total{route!~" in errors
    hits = BY_NAME["SkillcacheSkillHitRatioLow"]["expr"]
    assert 'skillcache_skill_hits_total{tier!="compiled"}' in hits
    assert BY_NAME["SkillcacheRedisDown"]["expr"].strip() == 'skillcache_store_up{tier="redis"} == 0'
    assert BY_NAME["SkillcacheRedisDown"]["labels"]["severity"] == "critical"
    assert "skillcache_queue_depth" in BY_NAME["SkillcacheQueueBacklog"]["expr"]


def _promtool() -> str:
    promtool = tool("promtool")
    if not promtool:
        missing("promtool not installed (Debian: apt-get install --no-install-recommends prometheus)")
    return promtool


def test_promtool_check_rules():
    proc = subprocess.run([_promtool(), "check", "rules", str(ALERTS_FILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests():
    """deploy/prometheus/alerts_test.yml: each alert fires on synthetic series, and stays quiet when healthy."""
    tests = ALERTS_FILE.with_name("alerts_test.yml")
    tested = {t["alertname"] for case in load_yaml(tests)["tests"] for t in case["alert_rule_test"]}
    assert tested == set(BY_NAME), f"alerts without a promtool test: {set(BY_NAME) - tested}"
    proc = subprocess.run([_promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
