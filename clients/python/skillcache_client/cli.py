"""The `skillcache` command line. Exit codes: 0 ok, 1 server (or connection) error, 2 usage."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx

from ._protocol import DEFAULT_URL
from .client import SkillcacheClient
from .errors import SkillcacheError
from .skillfile import SkillFileError, iter_skill_files, parse_skill_file


class UsageError(Exception):
    """Bad input from the command line (exit code 2)."""


def _field(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected k=v, got {value!r}")
    return key, val


def _skill_ref(value: str) -> str | dict[str, Any]:
    """`name` or `name@VERSION` (skill names never contain '@')."""
    name, sep, version = value.partition("@")
    if not sep:
        return name
    if not version.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME or NAME@VERSION, got {value!r}")
    return {"name": name, "version": int(version)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skillcache", description="Client for the skillcache service.")
    p.add_argument("--url", default=os.environ.get("SKILLCACHE_URL", DEFAULT_URL),
                   help="server URL (env SKILLCACHE_URL; default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("SKILLCACHE_API_KEY"),
                   help="bearer token (env SKILLCACHE_API_KEY)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the server (needs the 'service' package)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)

    skills = sub.add_parser("skills", help="manage skills").add_subparsers(
        dest="skills_command", metavar="ACTION", required=True)
    add = skills.add_parser("add", help="register skill files, or every skill file in folders")
    add.add_argument("paths", nargs="+", metavar="FILE_OR_FOLDER")
    lst = skills.add_parser("list", help="list skills")
    lst.add_argument("--json", action="store_true", help="print the raw JSON")
    show = skills.add_parser("show", help="print one skill's record as JSON")
    show.add_argument("name")
    show.add_argument("--version", type=int)
    rm = skills.add_parser("rm", help="delete a skill (every version)")
    rm.add_argument("name")

    c = sub.add_parser("compose", help="compose skills and generate a reply")
    c.add_argument("--skill", dest="skills", action="append", required=True, type=_skill_ref,
                   metavar="NAME[@VERSION]", help="a skill to include (repeatable, in order)")
    c.add_argument("--user", required=True, help="the user message ('-' reads stdin)")
    c.add_argument("--system", help="system text (the service places it after the skills)")
    c.add_argument("--field", dest="fields", action="append", type=_field, default=[], metavar="K=V",
                   help="a field value (repeatable)")
    c.add_argument("--max-tokens", type=int)
    c.add_argument("--temperature", type=float)
    c.add_argument("--top-p", type=float)
    c.add_argument("--seed", type=int)
    c.add_argument("--stop", action="append", help="a stop string (repeatable)")
    c.add_argument("--mode", choices=["compose", "full"])
    c.add_argument("--seam-tokens", type=int)
    c.add_argument("--no-stream", action="store_true", help="wait for the whole reply")

    sub.add_parser("health", help="print the server's readiness (exit 1 when not ready)")
    return p


# ---- commands -------------------------------------------------------------------------------


def _service_importable() -> bool:
    """Whether `python -m service` would find the server package (cwd counts, as it does for -m)."""
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec("service") is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def cmd_serve(args: argparse.Namespace) -> int:
    if not _service_importable():
        print("skillcache serve: the server package 'service' is not importable by "
              f"{sys.executable}.\nInstall the skillcache server into this environment (from the "
              "repository root: `make install` or `pip install -e .`), or run from the repository root.",
              file=sys.stderr)
        return 1
    argv = [sys.executable, "-m", "service", "--host", args.host, "--port", str(args.port)]
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 0  # not reached


def cmd_skills_add(client: SkillcacheClient, args: argparse.Namespace) -> int:
    files: list[Path] = []
    for path in args.paths:
        try:
            files.extend(iter_skill_files(path))
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    if not files:
        raise UsageError("no skill files found")
    try:
        parsed = [parse_skill_file(f) for f in files]  # all or nothing: check every file first
    except SkillFileError as e:
        raise UsageError(str(e)) from None
    failed = 0
    for i, skill in enumerate(parsed, 1):
        print(f"[{i}/{len(parsed)}] {skill['name']} ... ", end="", file=sys.stderr, flush=True)
        try:
            rec = client.add_skill(skill["name"], skill["text"], skill["description"], skill["fields"])
        except SkillcacheError as e:
            print(f"FAILED {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"v{rec.get('version', '?')} ({rec.get('n_tokens', '?')} tokens)", file=sys.stderr)
    if failed:
        print(f"{failed} of {len(parsed)} skill(s) failed", file=sys.stderr)
    return 1 if failed else 0


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def cmd_skills_list(client: SkillcacheClient, args: argparse.Namespace) -> int:
    skills = client.list_skills()
    if args.json:
        print(json.dumps(skills, indent=2))
    elif not skills:
        print("no skills", file=sys.stderr)
    else:
        rows = [["NAME", "VERSION", "TOKENS", "COMPILED", "SEAM", "DEGRADED", "HITS", "DESCRIPTION"]]
        for s in skills:
            cal, hits = s.get("calibration"), s.get("hits")
            rows.append([
                str(s.get("name", "")), str(s.get("version", "")), str(s.get("n_tokens", "")),
                _yes_no(s.get("compiled")),
                str(cal.get("seam", "?")) if isinstance(cal, dict) else "-" if "calibration" in s else "",
                _yes_no(s.get("degraded")),
                str(sum(hits.values())) if isinstance(hits, dict) else "",
                _clip(str(s.get("description") or ""), 60),
            ])
        _table(rows, sys.stdout)
    return 0


def _yes_no(value: object) -> str:
    """A boolean column: yes / no, blank when the server did not send it (an older server)."""
    return "" if value is None else "yes" if value is True else "no" if value is False else str(value)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def cmd_skills_show(client: SkillcacheClient, args: argparse.Namespace) -> int:
    print(json.dumps(client.get_skill(args.name, args.version), indent=2))
    return 0


def cmd_skills_rm(client: SkillcacheClient, args: argparse.Namespace) -> int:
    res = client.delete_skill(args.name)
    versions = ", ".join(str(v) for v in res.get("versions", []))
    print(f"deleted {res.get('deleted', args.name)}" + (f" (versions {versions})" if versions else ""))
    return 0


def _kv(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={round(v, 2) if isinstance(v, float) else v}" for k, v in values.items())


def _print_summary(final: Mapping[str, Any]) -> None:
    if final.get("finish_reason") is not None:
        print(f"finish_reason: {final['finish_reason']}", file=sys.stderr)
    for key in ("usage", "timings"):
        if isinstance(final.get(key), Mapping):
            print(f"{key}: {_kv(final[key])}", file=sys.stderr)


def cmd_compose(client: SkillcacheClient, args: argparse.Namespace) -> int:
    user = sys.stdin.read() if args.user == "-" else args.user
    kwargs: dict[str, Any] = dict(
        system=args.system, fields=dict(args.fields) or None, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop,
        mode=args.mode, seam_tokens=args.seam_tokens,
    )
    if args.no_stream:
        final = client.compose(args.skills, user, **kwargs)
        text = str(final.get("text", ""))
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        _print_summary(final)
        return 0
    last, final = "\n", {}
    try:
        for event in client.compose_stream(args.skills, user, **kwargs):
            if event.get("type") == "delta" and event.get("text"):
                sys.stdout.write(event["text"])
                sys.stdout.flush()
                last = event["text"]
            elif event.get("type") == "done":
                final = event
    finally:
        if not last.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
    _print_summary(final)
    return 0


def cmd_health(client: SkillcacheClient, args: argparse.Namespace) -> int:
    body = client.health()
    print(json.dumps(body, indent=2))
    return 0 if body.get("status") in ("ok", "ready") or body.get("ready") is True else 1


_COMMANDS = {
    ("skills", "add"): cmd_skills_add, ("skills", "list"): cmd_skills_list,
    ("skills", "show"): cmd_skills_show, ("skills", "rm"): cmd_skills_rm,
    ("compose", None): cmd_compose, ("health", None): cmd_health,
}


def main(argv: Sequence[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run the CLI; returns the exit code. `transport` is for tests (an httpx.MockTransport)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "serve":
        return cmd_serve(args)
    handler = _COMMANDS[(args.command, getattr(args, "skills_command", None))]
    try:
        with SkillcacheClient(args.url, args.api_key, args.timeout, transport=transport) as client:
            return handler(client, args)
    except UsageError as e:
        print(f"skillcache: {e}", file=sys.stderr)
        return 2
    except SkillcacheError as e:
        print(f"{e.error_type}: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
