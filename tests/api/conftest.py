import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.main import create_app
from tiny import tiny_runtime


def make_client(tmp_path, runtime=None, **overrides) -> TestClient:
    settings = Settings(home=tmp_path, store="disk", skills_dir=None, **overrides)
    app = create_app(settings, runtime=runtime or tiny_runtime("llama"))
    return TestClient(app)


@pytest.fixture
def client(tmp_path):
    with make_client(tmp_path) as c:
        app_state = c.app.state.skillcache
        c.portal.call(app_state.wait_ready)
        assert app_state.ready, app_state.load_error
        yield c
