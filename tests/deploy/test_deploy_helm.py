"""The Helm chart (deploy/helm/skillcache).

Two layers: checks on values.yaml and the template sources that need no renderer (always run), and checks on
manifests rendered by Helm itself (skip without a renderer; see conftest.py).
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import CHART, NAMESPACE, REPO, VLLM_IMAGE_PACKAGES, RenderError, connector_closure, load_yaml
from deploy_helpers import helm_lint, missing

VALUES = load_yaml(CHART / "values.yaml")
TEMPLATES = {p.name: p.read_text() for p in (CHART / "templates").iterdir()}
FULLNAME = "rel-skillcache"


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------------------------------------------------
# Without a renderer


def test_chart_metadata():
    chart = load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "skillcache"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert chart["appVersion"]


def test_every_template_kind_is_present():
    for name in ["deployment.yaml", "service.yaml", "configmap.yaml", "secret.yaml", "pdb.yaml", "hpa.yaml",
                 "servicemonitor.yaml", "prometheusrule.yaml", "redis.yaml", "_helpers.tpl", "NOTES.txt"]:
        assert name in TEMPLATES, name


def _walk(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (str(k),))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (str(i),))
    else:
        yield path, node


def test_values_hold_no_secret_material():
    assert VALUES["apiKeys"]["keys"] == []
    assert VALUES["apiKeys"]["existingSecret"] == ""
    assert VALUES["redis"]["external"]["url"] == ""
    secretish = re.compile(r"(password|passwd|secret|token|key)$", re.I)
    for path, value in _walk(VALUES):
        leaf = path[-1]
        if secretish.search(leaf) and leaf not in {"secretKey", "existingSecretKey"}:
            assert value in ("", None, [], {}), f"{'.'.join(path)} has a default value: {value!r}"
    assert not re.search(r"redis://[^\s@]*:[^\s@]+@", (CHART / "values.yaml").read_text()), "password in a URL"


def test_values_defaults_that_matter():
    assert VALUES["replicaCount"] >= 2, "the PDB (minAvailable 1) needs more than one replica"
    assert VALUES["store"] == "redis"
    assert VALUES["gpu"] == {"enabled": False, "count": 1, "resourceName": "nvidia.com/gpu", "tolerateTaint": True}
    assert VALUES["probes"]["startup"]["path"] == "/livez"
    assert VALUES["probes"]["liveness"]["path"] == "/livez"
    assert VALUES["probes"]["readiness"]["path"] == "/readyz"
    startup = VALUES["probes"]["startup"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model conversion needs a long startup"
    assert VALUES["pdb"] == {"enabled": True, "minAvailable": 1}
    assert VALUES["autoscaling"]["enabled"] is False
    assert VALUES["metrics"]["serviceMonitor"]["enabled"] is False
    assert VALUES["metrics"]["prometheusRule"]["enabled"] is False
    assert VALUES["redis"]["maxmemoryPolicy"] == "noeviction"
    assert VALUES["persistence"]["mountPath"] == "/data"
    assert VALUES["podSecurityContext"]["runAsNonRoot"] is True
    assert VALUES["podSecurityContext"]["runAsUser"] == 10001


def test_templates_reference_what_the_values_define():
    deployment = TEMPLATES["deployment.yaml"]
    for ref in [".Values.probes.startup.path", ".Values.probes.readiness.path", ".Values.probes.liveness.path",
                ".Values.gpu.resourceName", "startupProbe", "readinessProbe", "livenessProbe", "secretName"]:
        assert ref in deployment, ref
    assert "appendonly" in TEMPLATES["redis.yaml"]
    assert "redis.external.url" in TEMPLATES["_helpers.tpl"]
    assert "skillcache_queue_depth" in TEMPLATES["hpa.yaml"]
    assert '.Files.Get "files/alerts.yml"' in TEMPLATES["prometheusrule.yaml"]


def test_chart_alerts_are_the_prometheus_alerts():
    source = REPO / "deploy" / "prometheus" / "alerts.yml"
    copy = CHART / "files" / "alerts.yml"
    assert copy.read_bytes() == source.read_bytes(), (
        "deploy/helm/skillcache/files/alerts.yml differs from deploy/prometheus/alerts.yml: "
        "cp deploy/prometheus/alerts.yml deploy/helm/skillcache/files/alerts.yml"
    )


# ------------------------------------------------------------------------------------------------------------
# Rendered


def test_defaults(render):
    r = render()
    kinds = sorted(r.kinds())
    assert kinds == sorted(["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service",
                            "Service", "Service", "ServiceAccount", "StatefulSet"]), kinds
    for d in r.docs:
        assert d["metadata"].get("namespace") in (None, NAMESPACE)

    dep = r.deployment()
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = r.container()
    assert c["command"] == ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["startupProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["envFrom"] == [{"configMapRef": {"name": FULLNAME}}]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert c["image"] == "skillcache:0.1.0-cpu"
    assert "checksum/config" in dep["spec"]["template"]["metadata"]["annotations"]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    # SKILLCACHE_HOME is a writable volume (emptyDir by default); the read-only root gets /tmp and $HOME.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/data"]]["emptyDir"] == {}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "emptyDir" in volumes[mounts["/home/skillcache"]]
    assert "api-keys" not in volumes, "no keys configured: nothing to mount"

    config = r.config()
    assert config["SKILLCACHE_HOME"] == "/data"
    assert config["SKILLCACHE_STORE"] == "redis"
    assert config["SKILLCACHE_MODEL"] == "embedded"
    assert config["SKILLCACHE_REDIS_URL"] == f"redis://{FULLNAME}-redis:6379/0"
    assert "SKILLCACHE_API_KEYS_FILE" not in config
    assert all(isinstance(v, str) for v in config.values())

    pdb = r.one("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 1
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert _matches(pdb["spec"]["selector"]["matchLabels"], labels)
    assert _matches(dep["spec"]["selector"]["matchLabels"], labels)
    svc = r.one("Service", FULLNAME)
    assert _matches(svc["spec"]["selector"], labels)
    assert svc["spec"]["ports"][0]["port"] == 8000 and svc["spec"]["ports"][0]["targetPort"] == "http"


def test_bundled_redis(render):
    r = render()
    sts = r.one("StatefulSet")
    assert sts["metadata"]["name"] == f"{FULLNAME}-redis"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    joined = " ".join(str(a) for a in args)
    assert "--appendonly yes" in joined
    assert "--appendfsync everysec" in joined
    assert "--maxmemory-policy noeviction" in joined
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    redis_labels = sts["spec"]["template"]["metadata"]["labels"]
    app_labels = r.deployment()["spec"]["template"]["metadata"]["labels"]
    svc = r.one("Service", f"{FULLNAME}-redis")
    assert _matches(svc["spec"]["selector"], redis_labels)
    assert not _matches(svc["spec"]["selector"], app_labels)
    assert not _matches(r.one("Service", FULLNAME)["spec"]["selector"], redis_labels), "app Service hits Redis"
    netpol = r.one("NetworkPolicy")
    assert _matches(netpol["spec"]["podSelector"]["matchLabels"], redis_labels)
    assert _matches(netpol["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"], app_labels)
    # the URL the app gets points at this Service
    assert r.config()["SKILLCACHE_REDIS_URL"] == f"redis://{svc['metadata']['name']}:6379/0"


def test_gpu(render):
    r = render({"gpu": {"enabled": True}})
    c = r.container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["memory"] == "6Gi", "the GPU limit is added to, not instead of, the limits"
    assert c["image"] == "skillcache:0.1.0-cuda"
    assert r.config()["SKILLCACHE_DEVICE"] == "cuda"
    tolerations = r.deployment()["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations

    r = render({"gpu": {"enabled": True, "count": 2}, "config": {"SKILLCACHE_DEVICE": "cuda:1"}})
    assert r.container()["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert r.config()["SKILLCACHE_DEVICE"] == "cuda:1", "an explicit device wins"


def test_api_keys_from_existing_secret(render):
    r = render({"apiKeys": {"existingSecret": "my-keys"}})
    assert "Secret" not in r.kinds()
    pod = r.deployment()["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "my-keys"
    mount = next(m for m in r.container()["volumeMounts"] if m["name"] == "api-keys")
    assert mount["readOnly"] is True
    assert r.config()["SKILLCACHE_API_KEYS_FILE"] == f"{mount['mountPath']}/keys.json"
    assert volume["secret"]["items"] == [{"key": "keys.json", "path": "keys.json"}]


def test_api_keys_generated_secret(render):
    keys = [{"key_sha256": "0" * 64, "namespace": "team-a", "role": "admin"}]
    r = render({"apiKeys": {"keys": keys}})
    secret = r.one("Secret")
    assert json.loads(base64.b64decode(secret["data"]["keys.json"])) == keys
    volume = next(v for v in r.deployment()["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert "0" * 64 not in json.dumps(r.one("ConfigMap")), "key material leaked into the ConfigMap"
    annotations = r.deployment()["spec"]["template"]["metadata"]["annotations"]
    rotated = render({"apiKeys": {"keys": [{**keys[0], "role": "user"}]}})
    assert "checksum/api-keys" in annotations, "changing the keys must roll the pods"
    assert rotated.deployment()["spec"]["template"]["metadata"]["annotations"]["checksum/api-keys"] \
        != annotations["checksum/api-keys"]


def test_external_redis_url(render):
    r = render({"redis": {"external": {"url": "redis://shared-redis.infra:6379/3"}}})
    assert "StatefulSet" not in r.kinds() and "NetworkPolicy" not in r.kinds()
    assert r.config()["SKILLCACHE_REDIS_URL"] == "redis://shared-redis.infra:6379/3"


def test_external_redis_url_from_secret(render):
    r = render({"redis": {"external": {"existingSecret": "redis-url", "existingSecretKey": "uri"}}})
    assert "StatefulSet" not in r.kinds()
    assert "SKILLCACHE_REDIS_URL" not in r.config()
    env = {e["name"]: e for e in r.container()["env"]}
    assert env["SKILLCACHE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-url", "key": "uri"}


def test_disk_store(render):
    r = render({"store": "disk", "replicaCount": 1, "persistence": {"enabled": True}})
    assert "StatefulSet" not in r.kinds()
    assert r.config()["SKILLCACHE_STORE"] == "disk"
    assert "SKILLCACHE_REDIS_URL" not in r.config()
    pvc = r.one("PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    data = next(v for v in r.deployment()["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert "PodDisruptionBudget" not in r.kinds(), "a minAvailable=1 PDB over one replica blocks node drains"


def test_existing_claim(render):
    r = render({"persistence": {"enabled": True, "existingClaim": "shared-rwx"}})
    assert "PersistentVolumeClaim" not in r.kinds()
    data = next(v for v in r.deployment()["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"]["claimName"] == "shared-rwx"


def test_autoscaling(render):
    r = render({"autoscaling": {"enabled": True, "queueDepth": {"enabled": True}}})
    hpa = r.one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == r.deployment()["metadata"]["name"]
    assert "replicas" not in r.deployment()["spec"], "the HPA owns the replica count"
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "skillcache_queue_depth"
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert "PodDisruptionBudget" in r.kinds()


def test_monitoring(render):
    r = render({"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                            "prometheusRule": {"enabled": True}}})
    sm = r.one("ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert _matches(sm["spec"]["selector"]["matchLabels"], r.one("Service", FULLNAME)["metadata"]["labels"])
    rule = r.one("PrometheusRule")
    plain = load_yaml(REPO / "deploy" / "prometheus" / "alerts.yml")
    assert rule["spec"]["groups"] == plain["groups"], "the PrometheusRule must carry alerts.yml unchanged"
    assert "{{ $labels.mode }}" in json.dumps(rule), "Prometheus templates must survive Helm"


def test_single_replica_has_no_pdb(render):
    assert "PodDisruptionBudget" not in render({"replicaCount": 1}).kinds()


def test_bad_values_fail(render):
    with pytest.raises(RenderError):
        render({"store": "memory"})
    with pytest.raises(RenderError):
        render({"redis": {"enabled": False}})
    with pytest.raises(RenderError):
        render({"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}})


def test_notes(render, helm_renderer):
    if helm_renderer.helm:
        pytest.skip("`helm template` does not render NOTES.txt")
    assert "no API keys are configured" in render().notes
    assert "no API keys" not in render({"apiKeys": {"existingSecret": "k"}}).notes
    assert "store=disk with more than one replica" in render({"store": "disk"}).notes


SCENARIOS = [
    {},
    {"gpu": {"enabled": True}, "apiKeys": {"keys": [{"key_sha256": "ab", "namespace": "n", "role": "user"}]}},
    {"autoscaling": {"enabled": True, "queueDepth": {"enabled": True}}, "persistence": {"enabled": True}},
    {"redis": {"external": {"existingSecret": "r"}}, "extraEnv": [{"name": "X", "value": "1"}],
     "persistence": {"emptyDir": {"sizeLimit": "4Gi"}}},
]


@pytest.mark.parametrize("values", SCENARIOS, ids=["defaults", "gpu-keys", "hpa-pvc", "external-secret"])
def test_manifests_match_kubernetes_schemas(render, values):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate to check schemas")
    version = kv.latest_version()
    for doc in render(values).docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: no bundled schema
        kv.validate(doc, version, strict=True)


def test_helm_lint(helm_renderer):
    helm_lint(helm_renderer)


def test_rendered_yaml_is_plain(render):
    """No Go template leftovers ("<no value>", "%!") in any manifest."""
    text = yaml.safe_dump_all(render().docs)
    assert "<no value>" not in text and "%!" not in text


def test_no_keys_fails_at_render_time_with_what_to_set(helm_renderer):
    """Without keys the pods would crash-loop (the service refuses 0.0.0.0 without auth): say so at install."""
    if not helm_renderer.available:
        missing("no Helm renderer")
    with pytest.raises(RenderError) as err:
        helm_renderer.render({})
    assert "apiKeys.existingSecret" in str(err.value) and "SKILLCACHE_ALLOW_NO_AUTH" in str(err.value)
    for allow in ("1", "true"):
        assert helm_renderer.render({"config": {"SKILLCACHE_ALLOW_NO_AUTH": allow}}).deployment()


def test_a_readwriteonce_volume_is_replaced_not_surged(render):
    assert render().deployment()["spec"]["strategy"]["type"] == "RollingUpdate"
    pvc = render({"persistence": {"enabled": True}}).deployment()["spec"]["strategy"]
    assert pvc == {"type": "Recreate"}, pvc
    rwx = render({"persistence": {"enabled": True, "accessModes": ["ReadWriteMany"]}}).deployment()
    assert rwx["spec"]["strategy"]["type"] == "RollingUpdate"


def test_torch_threads_follow_a_whole_cpu_request(render):
    assert render().config()["SKILLCACHE_TORCH_THREADS"] == "1"
    assert render({"resources": {"requests": {"cpu": "4"}}}).config()["SKILLCACHE_TORCH_THREADS"] == "4"
    assert "SKILLCACHE_TORCH_THREADS" not in render({"resources": {"requests": {"cpu": "500m"}}}).config()
    assert render({"config": {"SKILLCACHE_TORCH_THREADS": "2"}}).config()["SKILLCACHE_TORCH_THREADS"] == "2"


# ------------------------------------------------------------------------------------------------------------
# vLLM as the engine: a sidecar in the skillcache pod


VLLM_ON = {"vllm": {"enabled": True}}


def test_vllm_values():
    v = VALUES["vllm"]
    assert v["enabled"] is False
    assert v["image"]["repository"] == "vllm/vllm-openai" and re.fullmatch(r"v\d+\.\d+\.\d+", v["image"]["tag"])
    assert v["dtype"] == "bfloat16", "what SKILLCACHE_VLLM_DTYPE=auto picks on a GPU, spelled out"
    assert v["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert v["port"] != VALUES["service"]["port"], "same pod: vLLM cannot take skillcache's port"


def test_vllm_off_by_default(render):
    r = render()
    pod = r.deployment()["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["skillcache"]
    assert "initContainers" not in pod
    assert not {"spans", "connector", "vllm-home", "dshm"} & {v["name"] for v in pod["volumes"]}
    assert not [k for k in r.config() if k == "SKILLCACHE_ENGINE" or k.startswith("SKILLCACHE_VLLM_")]
    assert "tolerations" not in pod


def _vllm(r) -> dict:
    containers = r.deployment()["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["skillcache", "vllm"]
    return containers[1]


def test_vllm_sidecar(render):
    from service.vllm.launch import SERVED_NAME, command, connector_config

    r = render(VLLM_ON)
    pod = r.deployment()["spec"]["template"]["spec"]
    vllm = _vllm(r)
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0"
    args = vllm["args"]
    connector = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert connector == json.loads(connector_config(Path("/spans")))
    assert connector["kv_role"] == "kv_both" and connector["kv_load_failure_policy"] == "recompute"
    launch = command(Path("/m"), 8100, Path("/spans"))
    assert args[args.index("--scheduling-policy") + 1] == launch[launch.index("--scheduling-policy") + 1]
    assert args[args.index("--served-model-name") + 1] == SERVED_NAME
    assert args[args.index("--host") + 1] == "127.0.0.1", "vLLM's API has no keys: the pod's loopback only"
    assert args[args.index("--port") + 1] == "8100"
    assert "--enable-prompt-tokens-details" in args
    assert vllm["command"][:2] == ["/bin/sh", "-c"]
    assert 'exec python3 -m vllm.entrypoints.openai.api_server --model "$m" "$@"' in vllm["command"][2]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["PYTHONPATH"] == "/opt/skillcache" and env["MODELS_ROOT"] == "/data/models"
    assert "ports" not in vllm
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "livenessProbe"):
        cmd = vllm[probe]["exec"]["command"]
        assert cmd[:2] == ["python3", "-c"] and "http://127.0.0.1:8100/health" in cmd[2]
        compile(cmd[2], probe, "exec")

    # skillcache: engine vllm, on the same pod's loopback, its dtype setting vLLM's
    config = r.config()
    assert config["SKILLCACHE_ENGINE"] == "vllm"
    assert config["SKILLCACHE_VLLM_URL"] == "http://127.0.0.1:8100"
    assert config["SKILLCACHE_VLLM_MODEL"] == SERVED_NAME
    assert config["SKILLCACHE_VLLM_DTYPE"] == args[args.index("--dtype") + 1] == "bfloat16"
    assert "SKILLCACHE_VLLM_SPANS_DIR" not in config, "skillcache reads no spans"
    assert r.container()["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness covers vLLM (the engine)"

    # the volumes: the spans in memory, vLLM's alone (the connector writes and reads them); the connector's code;
    # the model folder, shared read-only
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["spans"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    app_mounts = {m["mountPath"]: m for m in r.container()["volumeMounts"]}
    vllm_mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
    spans_dir = connector["kv_connector_extra_config"]["spans_dir"]
    assert vllm_mounts[spans_dir]["name"] == "spans" and not vllm_mounts[spans_dir].get("readOnly")
    assert "spans" not in {m["name"] for m in r.container()["volumeMounts"]}
    assert vllm_mounts["/data"]["name"] == app_mounts["/data"]["name"] == "data" and vllm_mounts["/data"]["readOnly"]
    assert vllm_mounts["/opt/skillcache"]["name"] == "connector"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and vllm_mounts["/dev/shm"]["name"] == "dshm"
    assert env["HOME"] in vllm_mounts, "vLLM's caches need a writable home (it runs as the pod's user)"

    # the connector is copied from the skillcache image into the shared folder before vLLM starts
    (init,) = pod["initContainers"]
    assert init["image"] == r.container()["image"]
    assert init["volumeMounts"] == [{"name": "connector", "mountPath": "/connector"}]
    code = init["command"][2]
    compile(code, "<init>", "exec")
    assert '"/connector/service"' in code, "lands as /opt/skillcache/service in vLLM, on its PYTHONPATH"

    # a GPU node: the usual taint is tolerated
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_vllm_init_copies_the_connector(tmp_path, render):
    """The initContainer's code, run against this checkout: every module vLLM imports through the connector lands
    under /connector (the service package, without bytecode caches)."""
    code = render(VLLM_ON).deployment()["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    code = code.replace('"/connector/service"', repr(str(tmp_path / "service")))
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    modules, external = connector_closure()
    for module in modules:
        rel = Path(*module.split("."))
        assert (tmp_path / rel.with_suffix(".py")).is_file() or (tmp_path / rel / "__init__.py").is_file(), module
    assert external <= VLLM_IMAGE_PACKAGES, sorted(external - VLLM_IMAGE_PACKAGES)
    assert not list(tmp_path.rglob("__pycache__"))


def test_vllm_options(render):
    r = render({"vllm": {"enabled": True, "dtype": "float16", "model": "/models/llama", "port": 8200,
                         "extraArgs": ["--max-model-len", "8192"], "spansSizeLimit": "4Gi",
                         "image": {"tag": "v0.33.0"}}})
    vllm = _vllm(r)
    args = vllm["args"]
    assert args[args.index("--dtype") + 1] == "float16" == r.config()["SKILLCACHE_VLLM_DTYPE"]
    assert args[-2:] == ["--max-model-len", "8192"]
    assert r.config()["SKILLCACHE_VLLM_URL"] == "http://127.0.0.1:8200"
    assert {e["name"]: e.get("value") for e in vllm["env"]}["MODEL_DIR"] == "/models/llama"
    assert vllm["image"].endswith(":v0.33.0")
    spans = next(v for v in r.deployment()["spec"]["template"]["spec"]["volumes"] if v["name"] == "spans")
    assert spans["emptyDir"]["sizeLimit"] == "4Gi"
    # with gpu.enabled too: one GPU each
    r = render({"vllm": {"enabled": True}, "gpu": {"enabled": True}})
    assert r.container()["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _vllm(r)["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_vllm_dtype_is_set_in_one_place(render):
    with pytest.raises(RenderError) as err:
        render({"vllm": {"enabled": True}, "config": {"SKILLCACHE_VLLM_DTYPE": "bfloat16"}})
    assert "vllm.dtype" in str(err.value)


def test_vllm_dtype_auto_is_refused(render):
    """vLLM's own --dtype auto is the model's dtype, not SKILLCACHE_VLLM_DTYPE=auto's rule (service/vllm/launch.py,
    which the chart does not run): the chart asks for the dtype itself."""
    with pytest.raises(RenderError) as err:
        render({"vllm": {"enabled": True, "dtype": "auto"}})
    assert "bfloat16, float16 or float32" in str(err.value)
    assert render({"vllm": {"enabled": False, "dtype": "auto"}}).config(), "only checked with vLLM on"


@pytest.mark.parametrize("values", [VLLM_ON, {"vllm": {"enabled": True}, "gpu": {"enabled": True},
                                              "persistence": {"enabled": True}}], ids=["vllm", "vllm-gpu-pvc"])
def test_vllm_manifests_match_kubernetes_schemas(render, values):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate to check schemas")
    version = kv.latest_version()
    for doc in render(values).docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kv.validate(doc, version, strict=True)
    text = yaml.safe_dump_all(render(values).docs)
    assert "<no value>" not in text and "%!" not in text
