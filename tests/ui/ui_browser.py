"""A real headless Chromium for the page tests: Debian's `chromium` and `chromium-driver` packages driven by
selenium, pointed at those binaries (selenium never downloads a browser or a driver here).

Missing pieces skip the tests, with the reason and the fix, unless SKILLCACHE_REQUIRE_BROWSER=1 (CI, .ci/run),
which makes them fail instead. scripts/ensure-chromium.sh installs the packages (as root, with apt).
"""

from __future__ import annotations

import os
import shutil
import tempfile

REQUIRE_ENV = "SKILLCACHE_REQUIRE_BROWSER"
BROWSERS = ("chromium", "chromium-browser")
DRIVERS = ("chromedriver", "chromium-driver")
# Flags that work in a container as root and keep the browser off the network: only 127.0.0.1 is reached.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1360,1900", "--force-device-scale-factor=1")


def _which(names: tuple[str, ...]) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the test extra: pip install -e '.[test]')"
    if _which(BROWSERS) is None:
        return "no chromium binary (apt-get install -y chromium chromium-driver, or scripts/ensure-chromium.sh)"
    if _which(DRIVERS) is None:
        return "no chromedriver binary (apt-get install -y chromium-driver, or scripts/ensure-chromium.sh)"
    return None


def require_browser() -> None:
    """pytest.skip without a browser, pytest.fail instead when SKILLCACHE_REQUIRE_BROWSER=1."""
    import pytest

    why = missing()
    if why is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why}, and {REQUIRE_ENV}=1")
    pytest.skip(why)


def chromium(profile_dir: str | None = None):
    """A selenium WebDriver on a fresh profile; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _which(BROWSERS)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir or tempfile.mkdtemp(prefix='sc-chromium-')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors, for failure messages
    return webdriver.Chrome(service=Service(_which(DRIVERS)), options=options)
