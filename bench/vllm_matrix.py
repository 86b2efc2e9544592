"""The vLLM version matrix of docs/SUPPORT.md: each tested release of vLLM's CPU build, what the connector does on it.

    flock /tmp/skillcache-heavy.lock .venv/bin/python bench/vllm_matrix.py --json bench/out/vllm-matrix.json

Each release runs from its own venv (`make test-vllm-matrix` installs them: .venv-vllm-<version>, the pinned one is
.venv-vllm), with the connector, in the dtype vLLM runs fastest here. Per release, the runs of bench/vllm_tp.py (the
shipped skills composed alone once, so vLLM compiles their blocks; then --cases composed cases, greedy) at TP=1 and
at TP=--tp, and these cells:
  loads heads     every TP=1 case loaded at least its composed tokens through the connector (vLLM's
                  prompt_tokens_by_source, external_kv_transfer), and no connector warning in vLLM's log
  saves blocks    rank 0 saved a record per compiled block and chain step (its spans dir), none refused
  priorities      under --scheduling-policy priority, a request at skillcache's background priority sent first and
                  one at live priority sent while it waits are both served, the live one first
  TP              at TP=--tp every case loaded all its composed tokens, first token equal to TP=1's in all but 2
  greedy text     the TP=1 composed greedy texts (--max-tokens) equal the pinned release's, case by case
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path
import httpx

from service.devserver import ROOT
from service.vllm.background import BACKGROUND, LIVE
from service.vllm.compat import TESTED
from service.vllm.launch import SERVED_NAME, fastest_dtype, model_dir

import vllm_tp  # noqa: E402  (bench/ is on sys.path)


def venv_python(version: str) -> Path:
    name = ".venv-vllm" if version == TESTED[-1] else f".venv-vllm-{version}"
    return ROOT / name / "bin" / "python"


def priorities(url: str) -> dict:
    """A long request at background priority, then (while vLLM runs it) two at live and background priority: the live
    one must finish before the second background one (priority orders vLLM's queue; it does not pause a step)."""
    ends: dict[str, float] = {}

    def send(name: str, n: int, priority: int) -> None:
        body = {"model": SERVED_NAME, "prompt": [1000 + (i % 500) for i in range(n)], "max_tokens": 8,
                "temperature": 0.0, "priority": priority, "cache_salt": f"matrix:{name}:{time.time()}"}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        ends[name] = time.perf_counter() if r.status_code == 200 else float("nan")
        if r.status_code != 200:
            ends[name + "_error"] = r.text[:300]  # type: ignore[assignment]

    first = threading.Thread(target=send, args=("background_long", 1500, BACKGROUND))
    first.start()
    time.sleep(0.3)
    rest = [threading.Thread(target=send, args=("background", 1200, BACKGROUND)),
            threading.Thread(target=send, args=("live", 1200, LIVE))]
    for t in rest:
        t.start()
        time.sleep(0.05)  # the background one queued first
    for t in [first, *rest]:
        t.join()
    served = all(isinstance(v, float) and v == v for k, v in ends.items() if not k.endswith("_error"))
    return {"served": served, "live_before_background": served and ends["live"] < ends["background"],
            "errors": {k: v for k, v in ends.items() if k.endswith("_error")}}


def version_of(python: Path) -> str:
    import subprocess

    r = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                       timeout=300)
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else "?"


def cells(tp1: dict, tpn: dict, pinned: dict | None) -> dict:
    n = len(tp1["cases"])
    warnings = sum(tp1["connector_warnings"].values())
    saved = sum(r["records"] for r in tp1["records"].values())
    first_equal = sum(a["first"] == b["first"] for a, b in zip(tp1["cases"], tpn["cases"]))
    same_text = None if pinned is None else sum(a["text"] == b["text"] for a, b in zip(tp1["cases"], pinned["cases"]))
    return {
        "loads_heads": {"ok": tp1["loaded_all_composed"] == n and warnings == 0,
                        "cases_loading_all": f"{tp1['loaded_all_composed']}/{n}",
                        "loaded": tp1["totals"]["external_kv_transfer"], "computed": tp1["totals"]["local_compute"],
                        "connector_warnings": tp1["connector_warnings"]},
        "saves_blocks": {"ok": saved > 0 and tp1["connector_warnings"].get("not saved", 0) == 0,
                         "records": tp1["records"]},
        "priorities": {"ok": bool(tp1.get("after", {}).get("live_before_background")), **tp1.get("after", {})},
        "tp": {"ok": tpn["loaded_all_composed"] == n and first_equal >= n - 2, "tp": tpn["tp"],
               "first_equal": f"{first_equal}/{n}", "cases_loading_all": f"{tpn['loaded_all_composed']}/{n}",
               "records": tpn["records"]},
        "greedy_text_equal_to_pinned": {"ok": same_text == n if same_text is not None else None,
                                        "equal": None if same_text is None else f"{same_text}/{n}"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=list(TESTED), help="releases (the pinned one is run first)")
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tp", type=int, default=3, help="the TP size checked beside TP=1 (the embedded model: 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--chat-template", default=None)
    ap.add_argument("--dtype", default=fastest_dtype()[0])
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--ready-timeout", type=float, default=1200.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    from service.config import Settings

    folder = model_dir(Settings(model=args.model))
    cases = vllm_tp.make_cases(args.cases, args.seed)
    versions = sorted(set(args.versions), key=lambda v: (v != TESTED[-1], v))  # the pinned one first: the reference
    out: dict = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "dtype": args.dtype, "cases": args.cases,
                 "max_tokens": args.max_tokens, "tested": list(TESTED), "pinned": TESTED[-1], "versions": {}}
    pinned_run = None
    for version in versions:
        python = venv_python(version)
        row: dict = {"venv": str(python.parents[1].name)}
        out["versions"][version] = row
        if not python.exists():
            row["error"] = f"{python} missing (make test-vllm-matrix installs it)"
            continue
        row["reports"] = version_of(python)
        work = Path(tempfile.mkdtemp(prefix=f"skillcache-vllm-matrix-{version}-"))
        try:
            tp1 = vllm_tp.run(1, args, folder, work, cases, python=python, after=priorities)
            tpn = vllm_tp.run(args.tp, args, folder, work, cases, python=python)
            if version == TESTED[-1]:
                pinned_run = tp1
            row["runs"] = {"tp1": tp1, f"tp{args.tp}": tpn}
            row["cells"] = cells(tp1, tpn, pinned_run)
        except Exception as e:  # a release that fails: its cells say why
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        write_json(args.json, out)
        print(f"vLLM {version}: " + ("; ".join(f"{k} {'ok' if v['ok'] else v['ok']}" for k, v in
                                               row.get("cells", {}).items()) or row.get("error", "")), flush=True)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
