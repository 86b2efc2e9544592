"""The `skillcache` CLI: argument parsing, each command against a fake server, and exit codes."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import httpx
import pytest
from skillcache_client import cli
from skillcache_fakes import DONE_EVENT, FakeServer, skill_record, sse, stream_response


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKILLCACHE_URL", raising=False)
    monkeypatch.delenv("SKILLCACHE_API_KEY", raising=False)


def run(server: FakeServer, *argv: str) -> int:
    return cli.main(list(argv), transport=server.transport())


def test_global_options_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.build_parser().parse_args(["skills", "list"])
    assert (args.url, args.api_key) == ("http://127.0.0.1:8000", None)
    monkeypatch.setenv("SKILLCACHE_URL", "http://env:1")
    monkeypatch.setenv("SKILLCACHE_API_KEY", "envkey")
    args = cli.build_parser().parse_args(["skills", "list"])
    assert (args.url, args.api_key) == ("http://env:1", "envkey")
    args = cli.build_parser().parse_args(["--url", "http://flag:2", "--api-key", "k", "skills", "list"])
    assert (args.url, args.api_key) == ("http://flag:2", "k")


def test_compose_arguments() -> None:
    args = cli.build_parser().parse_args([
        "compose", "--skill", "refund-policy", "--skill", "style-guide@2", "--user", "hi",
        "--field", "order_status=shipped", "--field", "note=a=b", "--max-tokens", "16",
        "--temperature", "0.2", "--mode", "full", "--no-stream",
    ])
    assert args.skills == ["refund-policy", {"name": "style-guide", "version": 2}]
    assert args.fields == [("order_status", "shipped"), ("note", "a=b")]
    assert (args.max_tokens, args.temperature, args.mode, args.no_stream) == (16, 0.2, "full", True)


@pytest.mark.parametrize("argv", [
    [], ["skills"], ["bogus"], ["compose", "--user", "hi"], ["compose", "--skill", "a"],
    ["compose", "--skill", "a", "--user", "u", "--field", "novalue"],
    ["compose", "--skill", "a@x", "--user", "u"], ["compose", "--skill", "a", "--user", "u", "--mode", "x"],
])
def test_usage_errors_exit_2(server: FakeServer, argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert run(server, *argv) == 2
    assert server.requests == []
    assert capsys.readouterr().err


def test_help_exits_0(server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    assert run(server, "--help") == 0
    assert "compose" in capsys.readouterr().out


def test_skills_add_folder(server: FakeServer, skills_dir: Path, capsys: pytest.CaptureFixture) -> None:
    server.on("POST", "/v1/skills", lambda r: httpx.Response(201, json=skill_record(
        json.loads(r.content)["name"], n_tokens=len(json.loads(r.content)["text"]) // 4)))
    assert run(server, "skills", "add", str(skills_dir)) == 0
    bodies = [json.loads(r.content) for r in server.requests]
    assert [b["name"] for b in bodies] == [
        "account-security", "escalation-playbook", "refund-policy", "shipping-faq", "style-guide", "tool-specs",
    ]
    refund = bodies[2]
    assert refund["fields"] == {"order_status": "delivered", "customer_tier": "standard"}
    assert refund["description"] and "{{order_status}}" in refund["text"]
    assert "fields" not in bodies[5] or bodies[5]["fields"] == {}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 6
    assert err[2] == f"[3/6] refund-policy ... v1 ({len(refund['text']) // 4} tokens)"


def test_skills_add_bad_file_uploads_nothing(server: FakeServer, skills_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.md"
    bad.write_text("---\nname: Bad\n---\nx")
    assert run(server, "skills", "add", str(skills_dir), str(bad)) == 2
    assert server.requests == []
    assert "invalid skill name" in capsys.readouterr().err
    assert run(server, "skills", "add", str(tmp_path / "missing")) == 2


def test_skills_add_server_error_continues(server: FakeServer, skills_dir: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        name = json.loads(r.content)["name"]
        if name == "style-guide":
            return httpx.Response(413, json={"error": {"type": "limit_exceeded", "message": "too long"}})
        return httpx.Response(200, json=skill_record(name, version=2))

    server.on("POST", "/v1/skills", handler)
    assert run(server, "skills", "add", str(skills_dir / "style-guide.md"), str(skills_dir / "tool-specs.md")) == 1
    err = capsys.readouterr().err
    assert "[1/2] style-guide ... FAILED limit_exceeded: too long" in err
    assert "[2/2] tool-specs ... v2 (812 tokens)" in err


def test_skills_list_rm_show(server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    calibrated = {"calibration": {"seam": 0, "passed": True}, "degraded": False, "hits": {"memory": 5, "compiled": 1}}
    server.on("GET", "/v1/skills", {"skills": [
        skill_record("refund-policy", 3, description="Retail refund rules", **calibrated),
        skill_record("x", compiled=False, calibration=None, degraded=True, hits={}),
        skill_record("old-server")]})
    server.on("DELETE", "/v1/skills/x", {"deleted": "x", "versions": [1, 2]})
    server.on("GET", "/v1/skills/x", skill_record("x"))
    assert run(server, "skills", "list") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "VERSION", "TOKENS", "COMPILED", "SEAM", "DEGRADED", "HITS", "DESCRIPTION"]
    assert out[1].split() == ["refund-policy", "3", "812", "yes", "0", "no", "6", "Retail", "refund", "rules"]
    assert out[2].split() == ["x", "1", "812", "no", "-", "yes", "0"]
    assert out[3].split() == ["old-server", "1", "812", "yes"]  # fields an older server does not send: blank
    assert run(server, "skills", "list", "--json") == 0
    assert json.loads(capsys.readouterr().out)[0]["name"] == "refund-policy"
    assert run(server, "skills", "rm", "x") == 0
    assert capsys.readouterr().out.strip() == "deleted x (versions 1, 2)"
    assert run(server, "skills", "show", "x", "--version", "1") == 0
    assert json.loads(capsys.readouterr().out)["name"] == "x"
    assert server.last.url.params["version"] == "1"
    assert run(server, "skills", "rm", "missing") == 1
    assert capsys.readouterr().err.strip() == "not_found: no route"


def test_compose_streams_to_stdout(server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    body = sse({"type": "delta", "text": "APPROVE\n"}, {"type": "delta", "text": "Rule 6."}, DONE_EVENT)
    server.on("POST", "/v1/compose", lambda r: stream_response(body, 9))
    code = run(server, "--api-key", "k", "compose", "--skill", "refund-policy", "--user", "Refund order A-1?",
               "--field", "order_status=shipped", "--max-tokens", "8", "--temperature", "0", "--mode", "compose")
    assert code == 0
    assert server.last_json() == {
        "skills": ["refund-policy"], "user": "Refund order A-1?", "stream": True,
        "fields": {"order_status": "shipped"}, "max_tokens": 8, "temperature": 0.0, "mode": "compose",
    }
    assert server.last.headers["authorization"] == "Bearer k"
    out, err = capsys.readouterr()
    assert out == "APPROVE\nRule 6.\n"
    assert "finish_reason: stop" in err
    assert "usage: prompt_tokens=900 reused_tokens=812 recomputed_tokens=88 completion_tokens=3" in err
    assert "timings: ttft_ms=41.5 compose_ms=3.25" in err


def test_compose_no_stream_and_stdin(server: FakeServer, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    server.on("POST", "/v1/compose", {"text": "DENY", "finish_reason": "stop", "usage": {"prompt_tokens": 5}})
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert run(server, "compose", "--skill", "a", "--user", "-", "--no-stream", "--system", "sys") == 0
    assert server.last_json() == {"skills": ["a"], "user": "from stdin", "stream": False, "system": "sys"}
    out, err = capsys.readouterr()
    assert out == "DENY\n" and "usage: prompt_tokens=5" in err


def test_compose_errors_exit_1(server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    server.on("POST", "/v1/compose", httpx.Response(404, json={"error": {"type": "skill_not_found",
                                                                         "message": "no skill 'nope'"}}))
    assert run(server, "compose", "--skill", "nope", "--user", "hi") == 1
    assert capsys.readouterr().err.strip() == "skill_not_found: no skill 'nope'"
    body = sse({"type": "delta", "text": "par"}, {"type": "error", "error": {"type": "internal_error",
                                                                           "message": "generation failed"}})
    server.on("POST", "/v1/compose", lambda r: stream_response(body))
    assert run(server, "compose", "--skill", "a", "--user", "hi") == 1
    out, err = capsys.readouterr()
    assert out == "par\n" and err.strip() == "internal_error: generation failed"


def test_connection_error_exit_1(capsys: pytest.CaptureFixture) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert cli.main(["skills", "list"], transport=httpx.MockTransport(refuse)) == 1
    assert capsys.readouterr().err.startswith("connection_error: cannot reach http://127.0.0.1:8000")


def test_health(server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    server.on("GET", "/readyz", httpx.Response(503, json={"status": "not_ready"}))
    assert run(server, "health") == 1
    server.on("GET", "/readyz", {"status": "ready"})
    assert run(server, "health") == 0


def test_serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cli.os, "execvp", lambda file, argv: calls.append((file, argv)))
    monkeypatch.setattr(cli, "_service_importable", lambda: False)
    assert cli.main(["serve"]) == 1
    assert "'service' is not importable" in capsys.readouterr().err and calls == []
    monkeypatch.setattr(cli, "_service_importable", lambda: True)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "9001"]) == 0
    assert calls == [(sys.executable, [sys.executable, "-m", "service", "--host", "0.0.0.0", "--port", "9001"])]


def test_service_importable_from_repo_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "__init__.py").write_text("")
    for mod in [m for m in sys.modules if m == "service" or m.startswith("service.")]:
        monkeypatch.delitem(sys.modules, mod)
    assert cli._service_importable() is True
    assert str(tmp_path) not in sys.path
