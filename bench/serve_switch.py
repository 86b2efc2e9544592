"""`python -m service` plus one route, for bench/background.py's `alternate` arm: POST /bench/background with
{"paused": true | false} pauses or resumes the engine's background work (ServingLoop.pause_background: queued
work waits, nothing is dropped). Benchmarks only: the service itself has no such route.

    python bench/serve_switch.py --port 8000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the service package of this tree

import uvicorn  # noqa: E402
from fastapi import Request  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from service.config import Settings  # noqa: E402
from service.main import configure_logging, create_app  # noqa: E402


class Switch(BaseModel):
    paused: bool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    configure_logging()
    app = create_app(Settings())

    @app.post("/bench/background")
    async def background(body: Switch, request: Request) -> dict:
        engine = request.app.state.skillcache.engine
        (engine.pause_background if body.paused else engine.resume_background)()
        return {"paused": body.paused}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="info", proxy_headers=False)


if __name__ == "__main__":
    main()
