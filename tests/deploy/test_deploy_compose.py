"""docker-compose.yml (+ docker-compose.gpu.yml): parsed as YAML always; `docker compose config` when a Compose v2
CLI is available (it validates against the Compose spec and merges the override without a Docker daemon)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from deploy_helpers import REPO, load_yaml, parse_duration

BASE = load_yaml(REPO / "docker-compose.yml")
GPU = load_yaml(REPO / "docker-compose.gpu.yml")


def test_redis_service():
    redis = BASE["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "--maxmemory 2gb" in command, "noeviction acts only with a maxmemory: without one Redis grows unbounded"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    volume = redis["volumes"][0]
    name, target = volume.split(":")[:2]
    assert target == "/data" and name in BASE["volumes"], "Redis' AOF lives on a named volume"
    assert "ports" not in redis, "Redis stays on the compose network"


def test_skillcache_service():
    app = BASE["services"]["skillcache"]
    assert app["build"]["context"] == "."
    assert app["build"]["args"]["BASE"] == "cpu", "plain `docker compose up` is the CPU path"
    assert app["depends_on"] == {"redis": {"condition": "service_healthy"}}
    env = app["environment"]
    assert env["SKILLCACHE_STORE"] == "redis"
    assert env["SKILLCACHE_REDIS_URL"] == "redis://redis:6379/0"
    assert env["SKILLCACHE_HOME"] == "/data"
    name, target = app["volumes"][0].split(":")[:2]
    assert target == env["SKILLCACHE_HOME"] and name in BASE["volumes"]
    assert any(p.endswith(":8000") and "8000" in p.split(":")[-2] for p in app["ports"]), app["ports"]
    assert "deploy" not in app, "no GPU reservation in the CPU path"


def test_skillcache_healthcheck():
    hc = BASE["services"]["skillcache"]["healthcheck"]
    assert hc["test"][:3] == ["CMD", "python", "-c"]
    assert "http://127.0.0.1:8000/readyz" in hc["test"][3], "healthy = model loaded (a failed load keeps /livez up)"
    compile(hc["test"][3], "<healthcheck>", "exec")
    assert parse_duration(hc["start_period"]) >= 60, "the first start converts the embedded model"


def test_gpu_override():
    app = GPU["services"]["skillcache"]
    assert set(GPU["services"]) == {"skillcache"}
    assert app["build"]["args"]["BASE"] == "cuda"
    assert app["image"] != BASE["services"]["skillcache"]["image"], "the two variants must not share a tag"
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy:
        out = subprocess.run([legacy, "version", "--short"], capture_output=True, text=True).stdout.strip()
        if out.lstrip("v").startswith("2"):
            return [legacy]
    return None


def _config(*files: str) -> dict:
    cli = _compose_cli()
    if not cli:
        pytest.skip("no Docker Compose v2 CLI (`docker compose` plugin or docker-compose v2 binary)")
    args = [a for f in files for a in ("-f", f)]
    proc = subprocess.run(
        [*cli, "--env-file", os.devnull, *args, "config", "--format", "json"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SKILLCACHE_"))},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_compose_config_cpu():
    cfg = _config("docker-compose.yml")
    app = cfg["services"]["skillcache"]
    assert app["build"]["args"]["BASE"] == "cpu"
    assert "deploy" not in app or not app["deploy"].get("resources")
    assert app["depends_on"]["redis"]["condition"] == "service_healthy"
    assert app["environment"]["SKILLCACHE_DEVICE"] == "auto"
    assert app["ports"][0]["target"] == 8000
    assert app["ports"][0]["host_ip"] == "127.0.0.1"
    assert {v["target"]: v["type"] for v in app["volumes"]} == {"/data": "volume"}
    assert parse_duration(app["healthcheck"]["start_period"]) >= 60


def test_compose_config_gpu():
    cfg = _config("docker-compose.yml", "docker-compose.gpu.yml")
    app = cfg["services"]["skillcache"]
    assert app["build"]["args"]["BASE"] == "cuda"
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == 1
    assert app["environment"]["SKILLCACHE_DEVICE"] == "cuda"
    # everything else survives the merge
    assert app["environment"]["SKILLCACHE_STORE"] == "redis"
    assert app["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "healthcheck" in app and app["volumes"]
