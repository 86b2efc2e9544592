"""Helpers for the deployment tests: repository paths, YAML loading, and a Helm renderer.

The Helm chart is rendered for real when a renderer is available, in this order:
  1. a `helm` binary on PATH (`helm template`),
  2. the `helm-python-sdk` package (Helm's Go SDK behind ctypes; `pip install helm-python-sdk`), run in a
     subprocess so its Go runtime never shares the pytest process.
Without either, the rendering tests skip (with that reason) and only the text-level checks run.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "skillcache"
RELEASE = "rel"
NAMESPACE = "ns"


def load_yaml(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


REQUIRE_TOOLS = "SKILLCACHE_REQUIRE_DEPLOY_TOOLS"  # .ci/run sets it: every check of the deployment files runs there


def missing(why: str):
    """A checker this machine lacks: the test skips, or fails where REQUIRE_TOOLS=1 (CI), so no check goes unrun
    there unnoticed."""
    if os.environ.get(REQUIRE_TOOLS) == "1":
        pytest.fail(f"{why}, and {REQUIRE_TOOLS}=1")
    pytest.skip(why)


def tool(name: str) -> str | None:
    """A CLI from PATH or from the running interpreter's bin dir (pip-installed linters land there)."""
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


# ------------------------------------------------------------------------------------------------------------
# Helm rendering


class RenderError(Exception):
    pass


@dataclass
class Rendered:
    docs: list[dict] = field(default_factory=list)  # every manifest, in template order
    notes: str = ""

    def kinds(self) -> list[str]:
        return [d["kind"] for d in self.docs]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
        return found[0]

    def deployment(self) -> dict:
        return self.one("Deployment")

    def container(self) -> dict:
        return self.deployment()["spec"]["template"]["spec"]["containers"][0]

    def config(self) -> dict:
        """The service's settings: the ConfigMap the container loads with envFrom."""
        name = self.container()["envFrom"][0]["configMapRef"]["name"]
        return self.one("ConfigMap", name)["data"]


def _parse(texts: dict[str, str]) -> Rendered:
    out = Rendered()
    for name in sorted(texts, key=lambda n: (n.endswith("NOTES.txt"), n)):
        text = texts[name]
        if name.endswith("NOTES.txt"):
            out.notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.docs.append(doc)
    return out


_SDK_SCRIPT = r"""
import json, sys
import helm_python as helm
chart, release, namespace = sys.argv[1:4]
jobs = json.load(sys.stdin)
results = {}
with helm.Chart.load(chart) as c:
    for key, values in jobs.items():
        try:
            results[key] = {"ok": c.render(values, name=release, namespace=namespace, is_install=True)}
        except Exception as e:  # a template `fail` or a values error: report, do not crash
            results[key] = {"error": f"{type(e).__name__}: {e}"}
json.dump(results, sys.stdout)
"""


class HelmRenderer:
    def __init__(self):
        self.helm = shutil.which("helm")
        self.sdk = False
        if not self.helm:
            probe = subprocess.run([sys.executable, "-c", "import helm_python"], capture_output=True)
            self.sdk = probe.returncode == 0
        self.cache: dict[str, Rendered | RenderError] = {}

    @property
    def available(self) -> bool:
        return bool(self.helm or self.sdk)

    @property
    def name(self) -> str:
        return f"helm binary {self.helm}" if self.helm else "helm-python-sdk" if self.sdk else "none"

    def render(self, values: dict | None = None) -> Rendered:
        key = json.dumps(values or {}, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = self._render(values or {})
        result = self.cache[key]
        if isinstance(result, RenderError):
            raise result
        return result

    def _render(self, values: dict) -> Rendered | RenderError:
        if self.helm:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(values, f)
            try:
                proc = subprocess.run(
                    [self.helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", f.name],
                    capture_output=True, text=True, timeout=120,
                )
            finally:
                os.unlink(f.name)
            if proc.returncode != 0:
                return RenderError(proc.stderr)
            return _parse({"manifests.yaml": proc.stdout})
        proc = subprocess.run(
            [sys.executable, "-c", _SDK_SCRIPT, str(CHART), RELEASE, NAMESPACE],
            input=json.dumps({"job": values}), capture_output=True, text=True, timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"helm-python-sdk renderer crashed: {proc.stderr[-2000:]}")
        result = json.loads(proc.stdout)["job"]
        if "error" in result:
            return RenderError(result["error"])
        return _parse(result["ok"])


# ------------------------------------------------------------------------------------------------------------
# Dockerfile


@dataclass
class Instruction:
    cmd: str  # upper-case keyword
    args: str  # the rest of the (joined) line
    stage: int  # index of the FROM it belongs to
    line: int  # 1-based line of the keyword
    heredocs: list[str] = field(default_factory=list)


_HEREDOC = re.compile(r"<<-?(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def parse_dockerfile(text: str) -> list[Instruction]:
    """Enough of the Dockerfile grammar for these tests: comments, line continuations, heredocs, stages."""
    lines = text.splitlines()
    out: list[Instruction] = []
    stage = -1
    i = 0
    while i < len(lines):
        raw = lines[i]
        start = i + 1
        i += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [raw]
        while parts[-1].rstrip().endswith("\\") and i < len(lines):
            parts[-1] = parts[-1].rstrip()[:-1]
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue  # comment lines inside a continuation are dropped
            parts.append(nxt)
        joined = " ".join(p.strip() for p in parts)
        cmd, _, args = joined.partition(" ")
        cmd = cmd.upper()
        heredocs = []
        if cmd in ("RUN", "COPY", "ADD"):
            # each heredoc on the instruction line is read in order; only the outer ones (the inner ones live
            # inside the first body and are the shell's business)
            for m in _HEREDOC.finditer(args):
                marker = m.group(2)
                body = []
                while i < len(lines) and lines[i] != marker:
                    body.append(lines[i])
                    i += 1
                i += 1  # the terminator
                heredocs.append("\n".join(body) + "\n")
        if cmd == "FROM":
            stage += 1
        out.append(Instruction(cmd, args.strip(), stage, start, heredocs))
    return out


def stage_names(instructions: list[Instruction]) -> list[str]:
    names = []
    for ins in instructions:
        if ins.cmd == "FROM":
            m = re.search(r"\s+AS\s+(\S+)\s*$", ins.args, re.I)
            names.append(m.group(1) if m else "")
    return names


def parse_env(args: str) -> dict[str, str]:
    import shlex

    env = {}
    for token in shlex.split(args):
        k, sep, v = token.partition("=")
        assert sep, f"legacy 'ENV key value' form not supported here: {args}"
        env[k] = v
    return env


def parse_duration(text: str) -> float:
    """'3m0s', '180s', '1m30s', '500ms' -> seconds (the Docker/compose duration syntax)."""
    total = 0.0
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text)):
        total += float(number) * units[unit]
    return total


# ------------------------------------------------------------------------------------------------------------
# .dockerignore (the moby/patternmatcher rules: last matching pattern wins; a pattern that matches a parent
# directory matches everything below it; '*' and '?' stop at '/', '**' crosses directories)


def _pattern_regex(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif c == "*":
            out += "[^/]*"
            i += 1
        elif c == "?":
            out += "[^/]"
            i += 1
        elif c == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out += "[" + ("^" + re.escape(body[1:]) if body.startswith("^") else re.escape(body)) + "]"
            i = end + 1
        else:
            out += re.escape(c)
            i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        pattern = line[1:].strip() if exclusion else line
        pattern = os.path.normpath(pattern.lstrip("/")).replace(os.sep, "/")
        rules.append((exclusion, _pattern_regex(pattern)))
    return rules


def dockerignore_excludes(rules, path: str) -> bool:
    """True when `path` (relative, '/'-separated) is left out of the build context."""
    parents = [path]
    parts = path.split("/")
    parents += ["/".join(parts[:n]) for n in range(1, len(parts))]
    excluded = False
    for exclusion, regex in rules:
        if any(regex.match(p) for p in parents):
            excluded = not exclusion
    return excluded


# ------------------------------------------------------------------------------------------------------------
# What vLLM imports from this repository: the connector and every service module it reaches

# Third-party packages a vLLM image has: vLLM itself and what it requires (torch, transformers, safetensors,
# pydantic; fastapi[standard] brings pydantic-settings). The connector's closure may import nothing else.
VLLM_IMAGE_PACKAGES = {"vllm", "torch", "transformers", "safetensors", "pydantic", "pydantic_settings"}


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(tree: ast.Module, in_functions: bool) -> list[tuple[str, list[str]]]:
    """(module, names) of the import statements that run: module level (not under `if TYPE_CHECKING`), and inside
    functions too where `in_functions`."""
    found: list[tuple[str, list[str]]] = []

    def visit(nodes, top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append((node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, top)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if in_functions:
                    visit(node.body, False)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, top)
            else:
                for field_name in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field_name, []) or [], top)

    visit(tree.body, True)
    return found


def connector_closure(root: str = "service.vllm.connector") -> tuple[set[str], set[str]]:
    """(service modules, third-party top-level packages) that importing the connector and calling its functions
    reaches: every import of the connector module (its functions' too: it builds the rotator lazily), and the
    module-level imports of each service module (with its parent packages) from there. A static walk: no torch or
    vllm needed."""
    modules: set[str] = set()
    external: set[str] = set()
    todo = [root]
    while todo:
        module = todo.pop()
        if module in modules:
            continue
        path = _module_file(module)
        assert path is not None, f"{module} is imported but not in the repository"
        modules.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages run first
        for name, names in _imports(ast.parse(path.read_text()), in_functions=module == root):
            top = name.split(".")[0]
            if top == "__future__":
                continue
            if top != "service":
                if top not in sys.stdlib_module_names:
                    external.add(top)
                continue
            todo.append(name)
            todo.extend(f"{name}.{n}" for n in names if _module_file(f"{name}.{n}") is not None)  # submodules
    return modules, external


def helm_lint(renderer, values: dict | None = None) -> None:
    """`helm lint --strict` of the chart (with `values`), by the helm binary or helm-python-sdk; fails on an error or
    a message above INFO ("icon is recommended")."""
    if renderer.helm:
        args = [renderer.helm, "lint", "--strict", str(CHART)]
        path = None
        if values is not None:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(values, f)
            path = f.name
            args += ["--values", path]
        try:
            proc = subprocess.run(args, capture_output=True, text=True)
        finally:
            if path:
                os.unlink(path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    if not renderer.sdk:
        missing("no Helm renderer: install a `helm` binary or `pip install helm-python-sdk`")
    code = ("import json, sys, helm_python as h; "
            "r = h.lint(sys.argv[1], json.loads(sys.argv[2]), strict=True); print(json.dumps(r))")
    proc = subprocess.run([sys.executable, "-c", code, str(CHART), json.dumps(values or {})], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    serious = [m for m in result["messages"] if m["severity"] > 1]
    assert not result["errors"] and not serious, result
