"""docker-compose.vllm-replicas.yml (two vLLM replicas, one shared block store) and the chart's vllm.sharedSpans:
parsed as YAML always; `config` through the Compose CLI and the chart rendered where the tools exist (as
test_deploy_compose.py and test_deploy_helm.py do)."""

from __future__ import annotations

import copy
import json

import pytest

from deploy_helpers import REPO, load_yaml
from test_deploy_compose import _config

REPLICAS = load_yaml(REPO / "docker-compose.vllm-replicas.yml")
VLLM = load_yaml(REPO / "docker-compose.vllm.yml")
FILES = ("docker-compose.yml", "docker-compose.vllm.yml", "docker-compose.vllm-replicas.yml")


def test_the_second_replica_is_the_first_with_its_own_spans_gpu_and_the_redis_url():
    first = copy.deepcopy(VLLM["services"]["vllm"])
    second = copy.deepcopy(REPLICAS["services"]["vllm-2"])
    assert "spans-2:/spans" in second["volumes"] and "spans:/spans" in first["volumes"]
    assert second["environment"].pop("SPANS_REDIS_URL") == "redis://redis:6379/0"
    assert second["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["${VLLM_2_GPU:-1}"]
    for s in (first, second):
        s["volumes"] = [v for v in s["volumes"] if not v.endswith(":/spans")]
        s.pop("deploy"), s.pop("depends_on")
    assert second == first, "vllm-2 drifted from docker-compose.vllm.yml's vllm"
    args = [str(a) for a in second["command"]]
    connector = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert connector["kv_connector_extra_config"] == {"spans_dir": "/spans"}  # Redis from the environment


def test_compose_config_replicas():
    cfg = _config(*FILES)
    app, one, two = (cfg["services"][n] for n in ("skillcache", "vllm", "vllm-2"))
    env = app["environment"]
    assert env["SKILLCACHE_VLLM_URL"] == "http://vllm:8000,http://vllm-2:8000"
    assert env["SKILLCACHE_VLLM_SHARED_SPANS"] == "true" and env["SKILLCACHE_REDIS_URL"] == "redis://redis:6379/0"
    assert "deploy" not in app or not app["deploy"].get("resources"), "skillcache reserves no GPU"
    for v in (one, two):
        assert v["environment"]["SPANS_REDIS_URL"] == env["SKILLCACHE_REDIS_URL"]
        assert "redis" in v["depends_on"]
    spans = {n: next(m["source"] for m in s["volumes"] if m["target"] == "/spans") for n, s in (("1", one), ("2", two))}
    assert spans == {"1": "spans", "2": "spans-2"}, "each replica its own local tier"
    assert cfg["volumes"]["spans-2"]["driver_opts"]["type"] == "tmpfs"


SHARED = {"vllm": {"enabled": True, "sharedSpans": True}}


def _vllm_env(r) -> dict:
    (vllm,) = [c for c in r.deployment()["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    return {e["name"]: e for e in vllm["env"]}


def test_helm_shared_spans_point_every_vllm_sidecar_at_the_stores_redis(render):
    r = render(SHARED)
    config = r.config()
    assert config["SKILLCACHE_VLLM_SHARED_SPANS"] == "true" and config["SKILLCACHE_STORE"] == "redis"
    assert _vllm_env(r)["SPANS_REDIS_URL"]["value"] == config["SKILLCACHE_REDIS_URL"]
    off = render({"vllm": {"enabled": True}})
    assert "SKILLCACHE_VLLM_SHARED_SPANS" not in off.config()
    assert "SPANS_REDIS_URL" not in _vllm_env(off)


def test_helm_shared_spans_take_a_secret_redis_url_and_need_the_redis_store(render):
    from deploy_helpers import RenderError

    r = render({**SHARED, "redis": {"external": {"existingSecret": "redis-url", "existingSecretKey": "url"}}})
    ref = _vllm_env(r)["SPANS_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "redis-url", "key": "url"}
    with pytest.raises(RenderError, match="store=redis"):
        render({**SHARED, "store": "disk"})
