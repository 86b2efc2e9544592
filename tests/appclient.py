"""An in-process app (TestClient, lifespan run) on a tiny random-weight model."""

from fastapi.testclient import TestClient

from service.config import Settings
from service.main import create_app
from tiny import tiny_runtime


def make_client(tmp_path, runtime=None, **overrides) -> TestClient:
    # background model work off by default here (timing-dependent results): random weights say nothing about
    # fidelity (tests/compose/test_guard.py); prefix refinement has its own tests (tests/compose/test_refine.py),
    # and so do automatic heads (exact counts of the other tests stay as they were)
    base = {"home": tmp_path, "store": "disk", "skills_dir": None, "seam_auto": False, "shadow_sample_rate": 0.0,
            "refine_after": 0, "auto_reuse": False}
    settings = Settings(**{**base, **overrides})
    return TestClient(create_app(settings, runtime=runtime or tiny_runtime("llama")))
