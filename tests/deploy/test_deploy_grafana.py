"""deploy/grafana: the dashboard is what deploy/grafana/dashboard.py writes, every metric and label a panel queries is
one the service exports (service/metrics.py), the panels cover what an operator needs, and the Helm chart offers
the same dashboard as a ConfigMap for Grafana's sidecar."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

import pytest
import yaml

from deploy_helpers import CHART, REPO, tool
from deploy_helpers import missing
from metric_names import METRICS, expr_problems, series_in

DASHBOARD_FILE = REPO / "deploy" / "grafana" / "skillcache.json"
CHART_COPY = CHART / "files" / "grafana-dashboard.json"
DASHBOARD = json.loads(DASHBOARD_FILE.read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
TARGETS = [(p["title"], t) for p in PANELS for t in p["targets"]]


def _generator():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", REPO / "deploy" / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_files_are_what_the_generator_writes():
    text = _generator().render()
    assert DASHBOARD_FILE.read_text() == text, ("deploy/grafana/skillcache.json is stale: "
                                                "python deploy/grafana/dashboard.py")
    assert CHART_COPY.read_text() == text, "the chart's copy is stale: python deploy/grafana/dashboard.py"


@pytest.mark.parametrize("target", TARGETS, ids=[f"{title}/{t['refId']}" for title, t in TARGETS])
def test_every_panel_query_uses_exported_metrics_and_labels(target):
    _, t = target
    assert expr_problems(t["expr"]) == []
    assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert 'job=~"$job", instance=~"$instance"' in t["expr"], "every query follows the job and instance variables"


def test_the_check_catches_what_the_service_does_not_export():
    assert expr_problems("rate(skillcache_ttft_seconds_bucket[5m])") == []
    assert expr_problems("rate(skillcache_ttft_second_bucket[5m])")  # a typo in the name
    assert expr_problems("sum by (tier) (rate(skillcache_ttft_seconds_bucket[5m]))")  # a label it does not carry
    assert expr_problems('skillcache_store_up{tiers="redis"}')
    assert expr_problems("up")


def test_panels_cover_what_the_issue_asks_for():
    used = set().union(*(series_in(t["expr"]) for _, t in TARGETS))
    wanted = {
        "skillcache_ttft_seconds_bucket",  # first-token latency by mode
        "skillcache_skill_hits_total",  # hits by tier
        "skillcache_prompt_tokens_total",  # composed vs exact-prefix vs recomputed tokens
        "skillcache_engine_sequences", "skillcache_engine_batch_size_bucket", "skillcache_engine_step_seconds_bucket",
        "skillcache_decode_tokens_total", "skillcache_queue_wait_seconds_bucket",
        "skillcache_engine_background_share", "skillcache_engine_kv_bytes", "skillcache_queue_depth",
        "skillcache_degraded_skills", "skillcache_shadow_checks_total",  # fidelity-guard demotions
        "skillcache_store_errors_total", "skillcache_store_up",  # Redis errors
    }
    assert wanted <= used, f"no panel for {sorted(wanted - used)}"
    ttft = next(t["expr"] for _, t in TARGETS if "skillcache_ttft_seconds_bucket" in t["expr"])
    assert "by (mode, le)" in ttft
    hits = next(t["expr"] for _, t in TARGETS if "skillcache_skill_hits_total" in t["expr"])
    assert "by (tier)" in hits
    assert all(name in METRICS for name in wanted)


def test_layout_and_template_variables():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
    for p in PANELS:
        assert p["title"] and p["description"] and p["targets"], p
        assert [t["refId"] for t in p["targets"]] == [chr(ord("A") + i) for i in range(len(p["targets"]))]
    names = [v["name"] for v in DASHBOARD["templating"]["list"]]
    assert names == ["datasource", "job", "instance"]
    for v in DASHBOARD["templating"]["list"][1:]:
        assert expr_problems(v["definition"].replace("label_values(", "").rsplit(",", 1)[0]) == []


def test_queries_parse_with_promtool(tmp_path):
    promtool = tool("promtool")
    if not promtool:
        missing("promtool not installed (Debian: apt-get install --no-install-recommends prometheus)")
    rules = [{"record": f"skillcache:dashboard:{i}",
              "expr": re.sub(r"\$__rate_interval", "5m", t["expr"]).replace("$job", ".*").replace("$instance", ".*")}
             for i, (_, t) in enumerate(TARGETS)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------------------
# The chart's ConfigMap


def _dashboard_maps(rendered) -> list[dict]:
    return [d for d in rendered.all("ConfigMap") if d["metadata"]["name"].endswith("-grafana-dashboard")]


def test_chart_offers_the_dashboard_to_grafanas_sidecar(render):
    assert _dashboard_maps(render()) == [], "off by default"
    cm, = _dashboard_maps(render({"metrics": {"grafanaDashboard": {"enabled": True}}}))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/name"] == "skillcache"
    assert "namespace" not in cm["metadata"]
    assert json.loads(cm["data"]["skillcache.json"]) == DASHBOARD  # byte for byte the same panels, {{legends}} too

    custom = {"enabled": True, "labels": {"dashboards": "ops"}, "annotations": {"grafana_folder": "skillcache"},
              "namespace": "monitoring"}
    cm, = _dashboard_maps(render({"metrics": {"grafanaDashboard": custom}}))
    assert cm["metadata"]["labels"]["dashboards"] == "ops" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    replaced = {**custom, "labels": {"dashboards": "ops", "grafana_dashboard": None}}  # Helm: null drops a default
    cm, = _dashboard_maps(render({"metrics": {"grafanaDashboard": replaced}}))
    assert cm["metadata"]["labels"]["dashboards"] == "ops" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "skillcache"}
    assert cm["metadata"]["namespace"] == "monitoring"


def test_dashboard_configmap_matches_the_kubernetes_schema(render):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate to check schemas")
    cm, = _dashboard_maps(render({"metrics": {"grafanaDashboard": {"enabled": True}}}))
    kv.validate(cm, kv.latest_version(), strict=True)
    assert len(json.dumps(cm)) < 1024 * 1024, "a ConfigMap holds at most 1 MiB"
