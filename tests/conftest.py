import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (tiny.py, appclient.py, redis_server.py)

from appclient import make_client  # noqa: E402


@pytest.fixture
def client(tmp_path):
    with make_client(tmp_path) as c:
        app_state = c.app.state.skillcache
        c.portal.call(app_state.wait_ready)
        assert app_state.ready, app_state.load_error
        yield c


@pytest.fixture(scope="session")
def embedded_runtime():
    """The real embedded model (SmolLM2-135M-Instruct), loaded once per test session."""
    from embedded_model import embedded_settings
    from service.runtime import build_runtime

    return build_runtime(embedded_settings())
