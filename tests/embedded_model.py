"""Settings for the real embedded model in tests: the user's model cache (converted once) is reused."""

import os
from pathlib import Path

from service.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def embedded_settings(**overrides) -> Settings:
    home = os.environ.get("SKILLCACHE_HOME")
    base = {"home": Path(home)} if home else {}
    return Settings(**{"model": "embedded", **base, **overrides})
