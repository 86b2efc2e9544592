"""docker-compose.yml (+ docker-compose.gpu.yml, docker-compose.vllm.yml): parsed as YAML always; `docker compose
config` when a Compose CLI is available (it validates against the Compose spec and merges the overrides without a
Docker daemon): a Compose v2 CLI, or Debian's docker-compose 1.29 (`apt-get install docker-compose`). Without one
the config tests skip, unless SKILLCACHE_REQUIRE_COMPOSE=1 (then they fail)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from deploy_helpers import REPO, load_yaml, parse_duration
from deploy_helpers import VLLM_IMAGE_PACKAGES, connector_closure, missing

BASE = load_yaml(REPO / "docker-compose.yml")
GPU = load_yaml(REPO / "docker-compose.gpu.yml")
VLLM = load_yaml(REPO / "docker-compose.vllm.yml")


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


def _compose_cli() -> tuple[list[str], int] | None:
    """The Compose CLI and its major version: `docker compose` (v2), else a docker-compose binary (v2 or 1.29)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"], 2
    legacy = shutil.which("docker-compose")
    if legacy:
        out = subprocess.run([legacy, "version", "--short"], capture_output=True, text=True).stdout.strip()
        version = tuple(int(x) for x in re.findall(r"\d+", out)[:2])
        if version and version[0] >= 2:
            return [legacy], 2
        if version >= (1, 28):  # the Compose spec (no `version:`), profiles, `deploy.resources` devices
            return [legacy], 1
    return None


def _cli_or_skip() -> tuple[list[str], int]:
    cli = _compose_cli()
    if not cli:
        why = "no Docker Compose CLI (`docker compose` plugin, or docker-compose: apt-get install docker-compose)"
        missing(why)
    return cli


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    """The files' defaults only: none of this shell's compose variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SKILLCACHE_", "VLLM_"))}
    return {**env, **(extra or {})}


def _v1_port(spec: str) -> dict:
    """docker-compose 1.29's "127.0.0.1:8000:8000/tcp" in v2's long form."""
    spec, _, protocol = spec.partition("/")
    *host, target = spec.split(":")
    host_ip, published = (host + [""])[:2] if len(host) == 2 else ("", host[0] if host else "")
    return {"host_ip": host_ip, "published": published, "target": int(target), "protocol": protocol or "tcp"}


def _v1_volume(spec: str) -> dict:
    """docker-compose 1.29's "source:target:mode" in v2's long form."""
    source, target, *mode = spec.split(":")
    kind = "bind" if source.startswith(("/", ".")) else "volume"
    return {"type": kind, "source": source, "target": target, "read_only": mode == ["ro"]}


def _config(*files: str, env: dict[str, str] | None = None) -> dict:
    """`config` of the files merged, in Compose v2's JSON shape (docker-compose 1.29's output is normalized to it)."""
    cli, major = _cli_or_skip()
    if major == 2:
        args = [a for f in files for a in ("-f", f)]
        proc = subprocess.run(
            [*cli, "--env-file", os.devnull, *args, "config", "--format", "json"], cwd=REPO, capture_output=True,
            text=True, timeout=60, env=_env(env),
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    # 1.29 predates the spec's top-level `name:` (v2 reads the project name from it): it gets copies without it
    # and the same name on its command line; paths still resolve against the repository (--project-directory).
    with tempfile.TemporaryDirectory() as tmp:
        args = []
        for f in files:
            doc = load_yaml(REPO / f)
            assert doc.pop("name", "skillcache") == "skillcache"
            copy = Path(tmp) / Path(f).name
            copy.write_text(yaml.safe_dump(doc, sort_keys=False))
            args += ["-f", str(copy)]
        empty = Path(tmp) / "empty.env"
        empty.write_text("")
        proc = subprocess.run(
            [*cli, "--project-directory", str(REPO), "--project-name", "skillcache", "--env-file", str(empty), *args,
             "config"], cwd=REPO, capture_output=True, text=True, timeout=60, env=_env(env),
        )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    for service in cfg["services"].values():
        service["ports"] = [_v1_port(p) for p in service.get("ports", [])]
        service["volumes"] = [_v1_volume(v) for v in service.get("volumes", [])]
        if isinstance(service.get("depends_on"), list):
            service["depends_on"] = {name: {"condition": "service_started"} for name in service["depends_on"]}
    return cfg


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


# ------------------------------------------------------------------------------------------------------------
# vLLM as the engine: docker-compose.vllm.yml


def _connector_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_vllm_override():
    from service.vllm.launch import SERVED_NAME, command, connector_config

    assert set(VLLM["services"]) == {"skillcache", "vllm"}
    vllm = VLLM["services"]["vllm"]
    assert re.fullmatch(r"vllm/vllm-openai:\$\{VLLM_IMAGE_TAG:-v\d+\.\d+\.\d+\}", vllm["image"]), vllm["image"]
    assert "profiles" not in vllm, "the override is the switch: a profile too would allow skillcache without vLLM"
    # the command line of service/vllm/launch.py: the connector (its spans on the spans volume), priority
    # scheduling, the served name
    args = [str(a) for a in vllm["command"]]
    assert _connector_config(args) == json.loads(connector_config(Path("/spans")))
    assert _connector_config(args)["kv_connector_module_path"] == "service.vllm.connector"
    assert _connector_config(args)["kv_role"] == "kv_both"
    assert _connector_config(args)["kv_load_failure_policy"] == "recompute"
    launch = command(Path("/m"), 8000, Path("/spans"))
    assert args[args.index("--scheduling-policy") + 1] == launch[launch.index("--scheduling-policy") + 1]
    assert args[args.index("--served-model-name") + 1] == SERVED_NAME
    assert "--enable-prompt-tokens-details" in args
    assert args[args.index("--port") + 1] == "8000"
    entry = vllm["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"] and "exec python3 -m vllm.entrypoints.openai.api_server" in entry[2]
    assert '"$$@"' in entry[2], "the command list reaches vLLM as its arguments"
    assert "/data/models/*/config.json" in entry[2], "waits for the model skillcache converts"

    # one variable for the dtype: vLLM's --dtype, and skillcache's setting says the same
    app = VLLM["services"]["skillcache"]
    env = app["environment"]
    assert args[args.index("--dtype") + 1] == env["SKILLCACHE_VLLM_DTYPE"] == "${SKILLCACHE_VLLM_DTYPE:-bfloat16}"
    assert env["SKILLCACHE_ENGINE"] == "vllm"
    assert env["SKILLCACHE_VLLM_URL"] == "http://vllm:8000"
    assert env["SKILLCACHE_VLLM_MODEL"] == SERVED_NAME

    # the spans: a memory-backed named volume in the vllm container only (skillcache never reads them); the
    # connector's code and the model come from skillcache's side, read-only
    spans = VLLM["volumes"]["spans"]["driver_opts"]
    assert spans["type"] == "tmpfs" and spans["device"] == "tmpfs" and "size=" in spans["o"]
    assert "volumes" not in app and "hostname" not in app, "skillcache mounts nothing for vLLM"
    mounts = vllm["volumes"]
    assert "spans:/spans" in mounts
    assert "./service:/opt/skillcache/service:ro" in mounts and vllm["environment"]["PYTHONPATH"] == "/opt/skillcache"
    assert f"skillcache-data:{BASE['services']['skillcache']['environment']['SKILLCACHE_HOME']}:ro" in mounts
    assert "skillcache-data" in BASE["volumes"]

    assert "ports" not in vllm, "vLLM's API has no keys: it stays on the compose network"
    assert vllm["deploy"] == GPU["services"]["skillcache"]["deploy"], "one GPU reserved, as in the GPU override"
    assert "/health" in vllm["healthcheck"]["test"][-1]
    compile(vllm["healthcheck"]["test"][-1], "<healthcheck>", "exec")


def _entrypoint(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The vllm service's entrypoint script, run by sh with a model folder in place and `python3` stubbed to print
    its arguments ($$ unescaped as compose does)."""
    model, fake = tmp_path / "model", tmp_path / "bin"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake / "python3").chmod(0o755)
    script = VLLM["services"]["vllm"]["entrypoint"][2].replace("$$", "$")
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "MODEL_DIR": str(model)}
    return subprocess.run(["sh", "-c", script, "vllm", *args], env=env, capture_output=True, text=True, timeout=30)


def test_vllm_override_entrypoint_refuses_auto(tmp_path):
    """vLLM's own --dtype auto is the model's dtype, not SKILLCACHE_VLLM_DTYPE=auto's rule (service/vllm/launch.py,
    which the override does not run): the entrypoint stops with what to set instead."""
    ok = _entrypoint(tmp_path / "ok", "--served-model-name", "skillcache", "--dtype", "bfloat16")
    assert ok.returncode == 0, ok.stderr
    model = str(tmp_path / "ok" / "model")
    assert ok.stdout.split() == ["-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--served-model-name", "skillcache", "--dtype", "bfloat16"]
    refused = _entrypoint(tmp_path / "auto", "--dtype", "auto", "--port", "8000")
    assert refused.returncode == 2 and "bfloat16, float16 or float32" in refused.stderr
    assert refused.stdout == ""


def test_vllm_override_connector_closure():
    """What vLLM imports from the mounted service/ folder: the connector and the modules it reaches, all in the
    repository, needing no package beyond vLLM's own dependencies (its image has those)."""
    modules, external = connector_closure()
    assert {"service.vllm.connector", "service.vllm.spans", "service.vllm.transfer"} <= modules
    assert external <= VLLM_IMAGE_PACKAGES, sorted(external - VLLM_IMAGE_PACKAGES)
    assert not [m for m in modules if m.startswith(("service.api", "service.engines"))], "not the service's app"


def test_vllm_override_names_only_real_settings():
    from service.config import Settings

    known = {f"SKILLCACHE_{name.upper()}" for name in Settings.model_fields}
    named = set(re.findall(r"\bSKILLCACHE_[A-Z0-9_]*[A-Z0-9]\b", (REPO / "docker-compose.vllm.yml").read_text()))
    assert named and named <= known, sorted(named - known)


def test_vllm_override_yamllint():
    probe = subprocess.run([sys.executable, "-m", "yamllint", "--version"], capture_output=True)
    if probe.returncode != 0:
        missing("yamllint not installed (pip install yamllint)")
    config = ("{extends: default, rules: {line-length: {max: 120}, document-start: disable, "
              "truthy: {check-keys: false}, comments: {min-spaces-from-content: 1}}}")
    proc = subprocess.run([sys.executable, "-m", "yamllint", "-f", "parsable", "-d", config,
                           "docker-compose.vllm.yml"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_config_vllm():
    cfg = _config("docker-compose.yml", "docker-compose.vllm.yml")
    assert set(cfg["services"]) == {"redis", "skillcache", "vllm"}
    app, vllm = cfg["services"]["skillcache"], cfg["services"]["vllm"]
    env = app["environment"]
    assert env["SKILLCACHE_ENGINE"] == "vllm" and env["SKILLCACHE_VLLM_URL"] == "http://vllm:8000"
    assert env["SKILLCACHE_VLLM_DTYPE"] == "bfloat16"
    assert not [k for k in env if k.startswith("SKILLCACHE_VLLM_") and k.endswith("_DIR")], "skillcache reads no spans"
    # the base survives the merge: store, model volume, published port, healthcheck (with the longer start)
    assert env["SKILLCACHE_STORE"] == "redis" and env["SKILLCACHE_HOME"] == "/data"
    assert app["ports"][0]["target"] == 8000 and app["ports"][0]["host_ip"] == "127.0.0.1"
    assert app["build"]["args"]["BASE"] == "cpu"
    assert parse_duration(app["healthcheck"]["start_period"]) >= 600
    assert "/readyz" in app["healthcheck"]["test"][-1]

    args = [str(a) for a in vllm["command"]]
    assert args[args.index("--dtype") + 1] == env["SKILLCACHE_VLLM_DTYPE"]
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    connector = _connector_config(args)
    assert connector["kv_role"] == "kv_both" and connector["kv_load_failure_policy"] == "recompute"
    assert connector["kv_connector_module_path"] == "service.vllm.connector"
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0"
    assert not vllm.get("ports")
    assert vllm["environment"]["PYTHONPATH"] == "/opt/skillcache"

    def mounts(service):
        return {v["target"]: v for v in service["volumes"]}

    # the connector's spans_dir is the spans volume, writable, in vLLM alone
    spans_dir = connector["kv_connector_extra_config"]["spans_dir"]
    assert mounts(vllm)[spans_dir]["type"] == "volume" and mounts(vllm)[spans_dir]["source"] == "spans"
    assert not mounts(vllm)[spans_dir].get("read_only")
    assert set(mounts(app)) == {"/data"}
    assert mounts(vllm)["/data"]["read_only"]
    assert mounts(app)["/data"]["source"] == mounts(vllm)["/data"]["source"] == "skillcache-data"
    code = mounts(vllm)["/opt/skillcache/service"]
    assert code["type"] == "bind" and code["read_only"]
    assert Path(code["source"]) == REPO / "service"
    assert cfg["volumes"]["spans"]["driver_opts"] == {"type": "tmpfs", "device": "tmpfs", "o": "size=2g,mode=1777"}
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == 1


def test_compose_config_vllm_dtype_is_one_variable():
    """float16 (a GPU without bfloat16): the one variable sets vLLM's --dtype and skillcache's setting."""
    cfg = _config("docker-compose.yml", "docker-compose.vllm.yml",
                  env={"SKILLCACHE_VLLM_DTYPE": "float16", "VLLM_MODEL": "/models/llama", "VLLM_SPANS_SIZE": "8g"})
    vllm = cfg["services"]["vllm"]
    args = [str(a) for a in vllm["command"]]
    assert args[args.index("--dtype") + 1] == "float16"
    assert cfg["services"]["skillcache"]["environment"]["SKILLCACHE_VLLM_DTYPE"] == "float16"
    assert vllm["environment"]["MODEL_DIR"] == "/models/llama"
    assert cfg["volumes"]["spans"]["driver_opts"]["o"] == "size=8g,mode=1777"


def test_compose_config_vllm_with_gpu_override():
    cfg = _config("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.vllm.yml")
    app = cfg["services"]["skillcache"]
    assert app["build"]["args"]["BASE"] == "cuda" and app["environment"]["SKILLCACHE_DEVICE"] == "cuda"
    assert app["environment"]["SKILLCACHE_ENGINE"] == "vllm"
    assert {v["target"] for v in app["volumes"]} == {"/data"}
