"""Time to ready, as a user meets it: the first start after install (the embedded model converted from its GGUF, the
prebuilt kernels loaded, the self-check, the shipped skills compiled) and a restart with the model cache in place.

    python bench/startup.py --json bench/out/startup.json [--restarts 3]

`python -m service` (what `make run` runs after its install step, which is up to date here), in a fresh
SKILLCACHE_HOME and model cache, on the machine's default threads, the shipped skills preloaded. The clock runs from
the process's start to the first `/readyz` 200; /readyz's `startup_s` gives each phase.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from common import write_json  # first: puts this checkout ahead of any installed copy on sys.path

from service.devserver import ROOT, ServiceProcess


def start(svc: ServiceProcess) -> dict:
    t0 = time.monotonic()
    svc.start()
    r = svc.wait_ready(900)
    wall = time.monotonic() - t0
    body = r.json()
    svc.stop()
    return {"ready_s": round(wall, 1), "phases_s": body.get("startup_s", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "startup.json"))
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="skillcache-startup-"))
    env = {"SKILLCACHE_MODEL_CACHE": str(home / "models"), "SKILLCACHE_SKILLS_DIR": str(ROOT / "skills")}
    svc = ServiceProcess(home / "home", env, name="startup", threads=None)
    (svc.home / "fingerprints.json").unlink(missing_ok=True)  # nothing carried over from this machine's own home
    out: dict = {}
    try:
        out["first"] = start(svc)
        print(f"first start (conversion included): ready in {out['first']['ready_s']} s {out['first']['phases_s']}",
              flush=True)
        out["restarts"] = []
        for _ in range(args.restarts):
            out["restarts"].append(start(svc))
            print(f"restart: ready in {out['restarts'][-1]['ready_s']} s {out['restarts'][-1]['phases_s']}",
                  flush=True)
    finally:
        svc.stop()
        shutil.rmtree(home, ignore_errors=True)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
