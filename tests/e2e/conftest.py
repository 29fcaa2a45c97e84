"""End-to-end fixtures: the integration suite's Postgres database per test and its process
helpers (tests/integration/procs.py), plus a live stack with test data and a headless Chromium.

A missing Postgres, Redis, Chromium or ChromeDriver fails the test with what to run; nothing is
skipped.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
# procs.py and friends are imported by their module names, as the integration tests do.
sys.path.insert(0, str(INTEGRATION))


def _integration_fixtures() -> Any:
    # Loaded under its own name: pytest already knows tests/integration/conftest.py as a
    # conftest, and its fixtures are reused here rather than copied.
    spec = importlib.util.spec_from_file_location(
        "integration_conftest", INTEGRATION / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_fixtures = _integration_fixtures()
empty_postgres_url = _fixtures.empty_postgres_url
postgres_url = _fixtures.postgres_url
redis_url = _fixtures.redis_url

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


@pytest.fixture
def artifacts() -> Path:
    """tests/e2e/artifacts/: screenshots kept after the run (gitignored)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Debian's ChromeDriver through selenium (which
    downloads nothing: the driver's path is given). Console messages are kept for the test."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: the dashboard tests need Debian's chromium and "
            "chromium-driver; run `bash scripts/install_browser.sh` (make test does)",
            pytrace=False,
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1440,2400",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(
        executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")
    )
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
