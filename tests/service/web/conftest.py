"""Fixtures of the page tests: `moecache serve` with the embedded model as a real process, and Debian's
headless Chromium driven by chromedriver through selenium (skipped where they are not installed)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serve_process import ServeProcess, serve_process

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
API_KEY = "page-test-key"
# No network here: nothing in the background may try to reach out or update itself.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage",
                  "--window-size=1400,1000")


@pytest.fixture(scope="module")
def page_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The embedded model (8 layers x 32 experts) with its experts behind an 8 MiB cache, keyed."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    settings = {"MOECACHE_CPU_MOE": "1", "MOECACHE_MOE_CACHE_MIB": "8", "MOECACHE_API_KEY": API_KEY}
    with serve_process(log, settings) as server:
        yield server


@pytest.fixture
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER),
                                                              log_output=os.devnull),
                              options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()
