"""python -m service [--host H] [--port P]: run the HTTP service with uvicorn (one worker per GPU)."""

from __future__ import annotations

import argparse

import uvicorn

from service.main import configure_logging, create_app


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m service", description="Run the skillcache HTTP service")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    configure_logging()
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
