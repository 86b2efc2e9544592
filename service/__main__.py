"""python -m service [--host H] [--port P]: run the HTTP service with uvicorn (one worker per GPU)."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from service.api.auth import AuthConfigError, check_exposure
from service.config import Settings
from service.main import configure_logging, create_app


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m service", description="Run the skillcache HTTP service")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    configure_logging()
    settings = Settings()
    try:
        check_exposure(settings, args.host)  # no keys: loopback only, unless SKILLCACHE_ALLOW_NO_AUTH=1
        app = create_app(settings)
    except AuthConfigError as e:
        print(f"skillcache: not starting: {e}", file=sys.stderr)
        sys.exit(2)
    # bounded: a 2,048-token stream could outlast compose's 30 s stop_grace_period, and a SIGKILL skips shutdown
    # proxy_headers off: uvicorn would otherwise trust X-Forwarded-For from loopback, where an auth-off service
    # listens, so any caller could pick its own rate-limit bucket (per client address when auth is off)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", proxy_headers=False,
                timeout_graceful_shutdown=settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
