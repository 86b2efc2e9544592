"""The Helm chart's vLLM tier (vllm.topology=statefulset): a StatefulSet of vllm.replicas vLLM pods behind a headless
Service, which every skillcache pod routes across (SKILLCACHE_VLLM_URL lists each pod by its DNS name), against the
sidecar topology (tests/deploy/test_deploy_helm.py) it shares its vllm container with.

Rendered by Helm itself where a renderer exists (see conftest.py), as test_deploy_helm.py does; the values checks
always run.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import CHART, NAMESPACE, REPO, RenderError, load_yaml
from deploy_helpers import helm_lint

VALUES = load_yaml(CHART / "values.yaml")
FULLNAME = "rel-skillcache"
VLLM_NAME = f"{FULLNAME}-vllm"

SIDECAR = {"vllm": {"enabled": True, "sharedSpans": True}}
TIER = {"vllm": {"enabled": True, "topology": "statefulset", "sharedSpans": True}}


def _tier(**vllm) -> dict:
    return {"vllm": {**TIER["vllm"], **vllm}}


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _sts(r) -> dict:
    return r.one("StatefulSet", VLLM_NAME)


def _vllm_pod(r) -> dict:
    return _sts(r)["spec"]["template"]["spec"]


def _vllm_container(r) -> dict:
    (c,) = _vllm_pod(r)["containers"]
    assert c["name"] == "vllm"
    return c


def _sidecar_container(r) -> dict:
    containers = r.deployment()["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["skillcache", "vllm"]
    return containers[1]


def _without_host(args: list[str]) -> list[str]:
    i = args.index("--host")
    return args[:i] + args[i + 2:]


# ------------------------------------------------------------------------------------------------------------
# Without a renderer


def test_tier_values():
    v = VALUES["vllm"]
    assert v["topology"] == "sidecar", "the sidecar stays the default: existing installs render as before"
    assert v["replicas"] == 2
    assert v["clusterDomain"] == "cluster.local"
    assert v["networkPolicy"] == {"enabled": True, "extraIngress": []}
    assert v["probes"]["readiness"]["periodSeconds"] > 0
    text = (CHART / "values.yaml").read_text()
    assert "needs two GPUs" not in text, "skillcache holds no model in vLLM mode: it needs no GPU"


# ------------------------------------------------------------------------------------------------------------
# The tier: StatefulSet, headless Service, the URLs skillcache routes across


@pytest.mark.parametrize("replicas", [2, 3])
def test_statefulset_of_n_replicas_behind_a_headless_service(render, replicas):
    r = render(_tier(replicas=replicas))
    sts = _sts(r)
    assert sts["spec"]["replicas"] == replicas
    assert sts["spec"]["podManagementPolicy"] == "Parallel", "peers: no replica waits for another to start"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _matches(sts["spec"]["selector"]["matchLabels"], pod_labels)

    svc = r.one("Service", sts["spec"]["serviceName"])
    assert svc["metadata"]["name"] == VLLM_NAME
    assert svc["spec"]["clusterIP"] == "None", "headless: one DNS name per pod, no load-balancing virtual IP"
    assert _matches(svc["spec"]["selector"], pod_labels)
    (port,) = svc["spec"]["ports"]
    container_ports = {p["name"]: p["containerPort"] for p in _vllm_container(r)["ports"]}
    assert port["port"] == container_ports[port["targetPort"]] == VALUES["vllm"]["port"]

    # skillcache's own objects never select vLLM's pods (and the headless Service none of skillcache's)
    app_labels = r.deployment()["spec"]["template"]["metadata"]["labels"]
    assert not _matches(r.deployment()["spec"]["selector"]["matchLabels"], pod_labels)
    assert not _matches(r.one("Service", FULLNAME)["spec"]["selector"], pod_labels)
    assert not _matches(r.one("PodDisruptionBudget", FULLNAME)["spec"]["selector"]["matchLabels"], pod_labels)
    assert not _matches(svc["spec"]["selector"], app_labels)


@pytest.mark.parametrize("values, port, domain", [
    (_tier(), 8100, "cluster.local"),
    (_tier(replicas=3, port=8200, clusterDomain="k8s.internal"), 8200, "k8s.internal"),
])
def test_skillcache_routes_across_every_replica_by_its_pod_dns_name(render, values, port, domain):
    from service.config import Settings

    r = render(values)
    sts = _sts(r)
    n = sts["spec"]["replicas"]
    # a StatefulSet's pod i is <name>-i, resolvable as <pod>.<serviceName>.<namespace>.svc.<domain>
    pods = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.svc.{domain}" for i in range(n)]
    expected = [f"http://{p}:{port}" for p in pods]
    assert expected[0] == f"http://{VLLM_NAME}-0.{VLLM_NAME}.{NAMESPACE}.svc.{domain}:{port}"

    config = r.config()
    assert config["SKILLCACHE_VLLM_URL"].split(",") == expected, "every replica, in order 0..N-1"
    assert Settings(vllm_url=config["SKILLCACHE_VLLM_URL"]).vllm_urls == expected, "as the service splits it"
    assert config["SKILLCACHE_ENGINE"] == "vllm"
    assert config["SKILLCACHE_VLLM_SHARED_SPANS"] == "true"
    assert config["SKILLCACHE_VLLM_MODEL"] == "skillcache"
    args = _vllm_container(r)["args"]
    assert config["SKILLCACHE_VLLM_DTYPE"] == args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--port") + 1] == str(port)


def test_skillcache_pods_run_no_vllm_and_ask_for_no_gpu(render):
    r = render(TIER)
    dep = r.deployment()
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["skillcache"]
    assert "initContainers" not in pod, "no connector to copy: vLLM runs elsewhere"
    assert not {"spans", "connector", "vllm-home", "dshm"} & {v["name"] for v in pod["volumes"]}
    assert "nvidia.com/gpu" not in json.dumps(dep), "skillcache holds no weights in vLLM mode: no GPU, no toleration"
    assert "tolerations" not in pod
    assert r.container()["image"].endswith("-cpu")


# ------------------------------------------------------------------------------------------------------------
# The vLLM pods


def test_vllm_container_is_the_sidecars_but_for_the_host(render):
    from service.vllm.launch import command

    sidecar, tier = _sidecar_container(render(SIDECAR)), _vllm_container(render(TIER))
    args = tier["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0", "the pod IP: skillcache's pods reach it over the network"
    assert sidecar["args"][sidecar["args"].index("--host") + 1] == "127.0.0.1"
    assert _without_host(args) == _without_host(sidecar["args"])

    # the command line service/vllm/launch.py builds (connector, priority scheduling, served name, dtype ...)
    launch = command(Path("/m"), 8100, Path("/spans"), dtype="bfloat16", host="0.0.0.0")
    launch = launch[launch.index("--served-model-name"):]
    i = args.index("--kv-transfer-config")
    j = launch.index("--kv-transfer-config")
    assert json.loads(args[i + 1]) == json.loads(launch[j + 1])
    assert args[:i + 1] + args[i + 2:] == launch[:j + 1] + launch[j + 2:]

    # everything else is the sidecar's: image, script, env (Redis URL included), probes, drain, resources, mounts
    assert tier["ports"] == [{"name": "http", "containerPort": 8100, "protocol": "TCP"}]
    assert tier["readinessProbe"]["exec"] == tier["startupProbe"]["exec"]
    strip = {"args", "ports", "readinessProbe"}
    assert {k: v for k, v in tier.items() if k not in strip} == {k: v for k, v in sidecar.items() if k not in strip}
    env = {e["name"]: e.get("value") for e in tier["env"]}
    assert env["SPANS_REDIS_URL"] == render(TIER).config()["SKILLCACHE_REDIS_URL"]


def test_vllm_pods_convert_their_own_model_and_copy_the_connector(render):
    r = render(TIER)
    pod = _vllm_pod(r)
    vllm = _vllm_container(r)
    assert [c["name"] for c in pod["initContainers"]] == ["connector", "model"]
    connector, model = pod["initContainers"]
    sidecar_pod = render(SIDECAR).deployment()["spec"]["template"]["spec"]
    assert connector == sidecar_pod["initContainers"][0], "the sidecar's connector copy, unchanged"

    # the model: converted from skillcache's SKILLCACHE_MODEL by skillcache's image into this pod's own data volume,
    # where the vllm container looks for it
    assert model["image"] == r.container()["image"]
    assert model["command"][:2] == ["python", "-c"]
    code = model["command"][2]
    compile(code, "<model>", "exec")
    assert "model_dir(Settings())" in code and "print(" in code
    env = {e["name"]: e.get("value") for e in model["env"]}
    assert env["SKILLCACHE_MODEL"] == r.config()["SKILLCACHE_MODEL"] == "embedded"
    home = env["SKILLCACHE_HOME"]
    init_mounts = {m["mountPath"]: m for m in model["volumeMounts"]}
    vllm_mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
    assert init_mounts[home]["name"] == vllm_mounts[home]["name"] == "data"
    assert not init_mounts[home].get("readOnly") and vllm_mounts[home]["readOnly"]
    vllm_env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert vllm_env["MODELS_ROOT"] == env["SKILLCACHE_MODEL_CACHE"] == f"{home}/models"
    assert vllm_env["MODEL_DIR"] == ""

    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}, "the pod's own: nothing is shared with skillcache"
    assert "persistentVolumeClaim" not in json.dumps(pod)
    assert volumes["spans"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and vllm_mounts["/dev/shm"]["name"] == "dshm"
    assert vllm_mounts["/spans"]["name"] == "spans" and vllm_mounts["/opt/skillcache"]["name"] == "connector"
    assert vllm_mounts[vllm_env["HOME"]]["name"] == "vllm-home"
    assert init_mounts["/tmp"]["name"] == "tmp" and "emptyDir" in volumes["tmp"]

    # the pod: skillcache's security context, no API token, the GPU taint tolerated, a drain before SIGTERM
    assert pod["securityContext"] == r.deployment()["spec"]["template"]["spec"]["securityContext"]
    assert pod["automountServiceAccountToken"] is False
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "20"]
    assert model["securityContext"]["readOnlyRootFilesystem"] is True


def test_model_init_prints_the_folder_the_vllm_container_serves(tmp_path, render):
    """The initContainer's code, run against this checkout (an HF folder as SKILLCACHE_MODEL: model_dir's path with
    no conversion), prints the folder; the vllm container's script, with `python3` stubbed to print its arguments,
    serves the one folder under MODELS_ROOT, where the conversion of the embedded model or a .gguf lands."""
    r = render(TIER)
    model = _vllm_pod(r)["initContainers"][1]
    home = tmp_path / "data"
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    env = {e["name"]: e["value"] for e in model["env"]}
    env.update(SKILLCACHE_HOME=str(home), SKILLCACHE_MODEL_CACHE=str(home / "models"), SKILLCACHE_MODEL=str(hf),
               HOME=str(tmp_path), PATH=os.environ["PATH"], PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *model["command"][1:]], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(hf)

    # the converted folder, as convert_gguf leaves it (<models>/<name>-<digest>/config.json, the lock beside it)
    converted = home / "models" / "SmolLM2-135M-Instruct-0123456789abcdef"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (home / "models" / ".convert.lock").write_text("")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake / "python3").chmod(0o755)
    vllm = _vllm_container(r)
    venv = {e["name"]: e.get("value") for e in vllm["env"]}
    script = {"PATH": f"{fake}:{os.environ['PATH']}", "MODEL_DIR": venv["MODEL_DIR"],
              "MODELS_ROOT": str(home / "models")}
    run = subprocess.run(["sh", *vllm["command"][1:], *vllm["args"]], env=script, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(converted),
                                       *vllm["args"]]


def test_network_policy_admits_only_skillcache_pods_to_vllm(render):
    r = render(TIER)
    vllm_labels = _sts(r)["spec"]["template"]["metadata"]["labels"]
    app_labels = r.deployment()["spec"]["template"]["metadata"]["labels"]
    redis_labels = r.one("StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["metadata"]["labels"]
    netpol = r.one("NetworkPolicy", VLLM_NAME)
    assert _matches(netpol["spec"]["podSelector"]["matchLabels"], vllm_labels)
    assert not _matches(netpol["spec"]["podSelector"]["matchLabels"], app_labels)
    assert netpol["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = netpol["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "pods of this namespace only"
    assert _matches(peer["podSelector"]["matchLabels"], app_labels)
    assert not _matches(peer["podSelector"]["matchLabels"], vllm_labels)
    assert not _matches(peer["podSelector"]["matchLabels"], redis_labels)
    assert rule["ports"] == [{"port": 8100, "protocol": "TCP"}]

    # the bundled Redis admits the vLLM pods too: their connectors share records there (sidecar: the app pods are)
    redis_from = r.one("NetworkPolicy", f"{FULLNAME}-redis")["spec"]["ingress"][0]["from"]
    assert [_matches(p["podSelector"]["matchLabels"], vllm_labels) for p in redis_from] == [False, True]
    sidecar_from = render(SIDECAR).one("NetworkPolicy", f"{FULLNAME}-redis")["spec"]["ingress"][0]["from"]
    assert len(sidecar_from) == 1

    extra = {"from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}], "ports": [{"port": 8100}]}
    r = render(_tier(networkPolicy={"enabled": True, "extraIngress": [extra]}))
    assert r.one("NetworkPolicy", VLLM_NAME)["spec"]["ingress"][1] == extra
    names = [d["metadata"]["name"] for d in render(_tier(networkPolicy={"enabled": False})).all("NetworkPolicy")]
    assert names == [f"{FULLNAME}-redis"]


def test_vllm_pdb_follows_the_apps(render):
    r = render(TIER)
    pdb = r.one("PodDisruptionBudget", VLLM_NAME)
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 1
    assert _matches(pdb["spec"]["selector"]["matchLabels"], _sts(r)["spec"]["template"]["metadata"]["labels"])
    one = render(_tier(replicas=1))
    assert [d["metadata"]["name"] for d in one.all("PodDisruptionBudget")] == [FULLNAME], "one pod: no budget"
    assert one.config()["SKILLCACHE_VLLM_URL"].count("http://") == 1
    assert "PodDisruptionBudget" not in render({**_tier(), "pdb": {"enabled": False}}).kinds()


def test_vllm_pod_scheduling_and_model_options(render):
    values = _tier(model="/models/llama", extraVolumes=[{"name": "llama", "persistentVolumeClaim": {"claimName": "m"}}],
                   extraVolumeMounts=[{"name": "llama", "mountPath": "/models", "readOnly": True}],
                   nodeSelector={"gpu": "h100"}, tolerations=[{"key": "k", "operator": "Exists"}],
                   podAnnotations={"a": "b"}, extraArgs=["--max-model-len", "8192"])
    values["config"] = {"SKILLCACHE_MODEL": "/models/llama"}
    r = render(values)
    pod = _vllm_pod(r)
    assert [c["name"] for c in pod["initContainers"]] == ["connector"], "vllm.model: nothing to convert"
    vllm = _vllm_container(r)
    assert {e["name"]: e.get("value") for e in vllm["env"]}["MODEL_DIR"] == "/models/llama"
    assert {"name": "llama", "mountPath": "/models", "readOnly": True} in vllm["volumeMounts"]
    assert {"name": "llama", "persistentVolumeClaim": {"claimName": "m"}} in pod["volumes"]
    assert vllm["args"][-2:] == ["--max-model-len", "8192"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"][0] == {"key": "k", "operator": "Exists"} and len(pod["tolerations"]) == 2
    assert _sts(r)["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}
    assert "nodeSelector" not in r.deployment()["spec"]["template"]["spec"], "skillcache's pods schedule as before"

    gguf = render({**_tier(convert={"extraVolumeMounts": [{"name": "g", "mountPath": "/g"}]}),
                   "config": {"SKILLCACHE_MODEL": "/g/m.Q4_K_M.gguf"}})
    model = _vllm_pod(gguf)["initContainers"][1]
    assert {e["name"]: e["value"] for e in model["env"]}["SKILLCACHE_MODEL"] == "/g/m.Q4_K_M.gguf"
    assert {"name": "g", "mountPath": "/g"} in model["volumeMounts"]


# ------------------------------------------------------------------------------------------------------------
# What the chart refuses


def test_tier_needs_shared_spans_on_the_redis_store(render):
    with pytest.raises(RenderError) as err:
        render({"vllm": {"enabled": True, "topology": "statefulset"}})
    message = str(err.value)
    assert "vllm.topology=statefulset needs vllm.sharedSpans=true and store=redis" in message
    assert "not compiled again" in message, "says why"
    with pytest.raises(RenderError, match="store=redis"):
        render({**TIER, "store": "disk", "replicaCount": 1})
    with pytest.raises(RenderError, match="store=redis"):
        render({"vllm": {"enabled": True, "topology": "statefulset"}, "store": "disk", "replicaCount": 1})


def test_tier_refusals(render):
    with pytest.raises(RenderError, match="vllm.topology must be"):
        render({"vllm": {"enabled": True, "topology": "deployment"}})
    with pytest.raises(RenderError, match="vllm.replicas must be at least 1"):
        render(_tier(replicas=0))
    with pytest.raises(RenderError, match="SKILLCACHE_VLLM_URL"):
        render({**TIER, "config": {"SKILLCACHE_VLLM_URL": "http://x:8000"}})
    with pytest.raises(RenderError, match="set vllm.model"):
        render({**TIER, "config": {"SKILLCACHE_MODEL": "/models/llama"}})


# ------------------------------------------------------------------------------------------------------------
# The sidecar is unchanged


def test_sidecar_is_the_default_topology_and_the_tier_needs_vllm_enabled(render):
    assert render({"vllm": {"enabled": True}}).docs == render({"vllm": {"enabled": True, "topology": "sidecar"}}).docs
    r = render(SIDECAR)
    assert [d["metadata"]["name"] for d in r.all("StatefulSet")] == [f"{FULLNAME}-redis"]
    assert r.config()["SKILLCACHE_VLLM_URL"] == "http://127.0.0.1:8100"
    assert render({"vllm": {"topology": "statefulset", "sharedSpans": True}}).docs == render().docs, \
        "vllm.enabled off: no vLLM in either topology"


def test_notes(render, helm_renderer):
    if helm_renderer.helm:
        pytest.skip("`helm template` does not render NOTES.txt")
    notes = render(TIER).notes
    assert f"StatefulSet of\n2 pods ({VLLM_NAME}-0..1)" in notes
    assert "as a sidecar" not in notes and "gpu.enabled with vLLM" not in notes
    assert "gpu.enabled with vLLM" in render({**TIER, "gpu": {"enabled": True}}).notes


# ------------------------------------------------------------------------------------------------------------
# Both topologies against the Kubernetes schemas and helm lint (as test_deploy_helm.py checks the chart)


TOPOLOGIES = [
    SIDECAR,
    TIER,
    {**_tier(replicas=4, networkPolicy={"enabled": True, "extraIngress": [{"from": [{"podSelector": {}}]}]}),
     "apiKeys": {"keys": [{"key_sha256": "ab", "namespace": "n", "role": "user"}]}},
    {**_tier(model="/m", extraVolumes=[{"name": "m", "emptyDir": {}}],
             extraVolumeMounts=[{"name": "m", "mountPath": "/m"}]),
     "redis": {"external": {"existingSecret": "r"}}, "config": {"SKILLCACHE_MODEL": "/m"}},
]
TOPOLOGY_IDS = ["sidecar", "statefulset", "statefulset-4-keys", "statefulset-hf-secret-redis"]


@pytest.mark.parametrize("values", TOPOLOGIES, ids=TOPOLOGY_IDS)
def test_topologies_match_kubernetes_schemas(render, values):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate to check schemas")
    version = kv.latest_version()
    r = render(values)
    for doc in r.docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kv.validate(doc, version, strict=True)
    text = yaml.safe_dump_all(r.docs)
    assert "<no value>" not in text and "%!" not in text


def test_topologies_pass_helm_lint(helm_renderer):
    values = copy.deepcopy(TIER)
    values["config"] = {"SKILLCACHE_ALLOW_NO_AUTH": "1"}
    helm_lint(helm_renderer, values)
