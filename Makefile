# Two commands a newcomer needs:  make run  (the service on the embedded model)  and  make test.
HOST ?= 127.0.0.1
PORT ?= 8000
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run run-vllm test test-fast test-vllm-matrix lint screenshot clean

install:
	@scripts/install.sh $(VENV)

run: install
	$(PY) -m service --host $(HOST) --port $(PORT)

# skillcache in front of vLLM's CPU build (its own venv, .venv-vllm, installed on first use; vLLM on a free port)
run-vllm:
	@HOST=$(HOST) PORT=$(PORT) VENV=$(VENV) scripts/run-vllm.sh

test: install
	@scripts/ensure-redis.sh || echo "note: redis-server unavailable; Redis tests will be skipped"
	@scripts/ensure-chromium.sh || echo "note: chromium unavailable; the playground's browser test will be skipped"
	@scripts/install-vllm.sh || echo "note: vLLM's CPU build unavailable; the vLLM engine's tests will be skipped"
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff, configured in pyproject.toml; .ci/run runs it before the tests
lint: install
	$(PY) -m ruff check service bench tests clients
	$(PY) -m mypy

# The vLLM tests on each tested vLLM release (a venv each, kept between runs), then docs/SUPPORT.md's matrix
test-vllm-matrix: install
	@PY=$(PY) scripts/test-vllm-matrix.sh

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The README's picture of the playground, taken by its browser test (tests/ui) against the embedded model.
screenshot: install
	@scripts/ensure-chromium.sh
	SKILLCACHE_SCREENSHOT=docs/img/playground.png SKILLCACHE_REQUIRE_BROWSER=1 $(PY) -m pytest -q tests/ui -k browser

clean:
	rm -rf $(VENV) .pytest_cache
