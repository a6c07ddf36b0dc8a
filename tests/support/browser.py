"""Headless Chromium from the distribution's packages (`chromium`, `chromium-driver`), driven by
Selenium with the driver's path given, so Selenium downloads nothing. Absent here, the browser tests
skip; under CI (.ci/run installs both) they fail instead."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver"


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def chromium_paths(
    names: tuple[str, ...] = CHROMIUM_NAMES, chromedriver: str = CHROMEDRIVER
) -> tuple[str, str] | None:
    """(browser, driver), or None on a machine without them (an error under CI, where they must be)."""
    browser = next((path for name in names if (path := shutil.which(name))), None)
    driver = chromedriver if Path(chromedriver).is_file() else None
    try:
        import selenium  # noqa: F401
    except ImportError:
        browser = None
    if browser and driver:
        return browser, driver
    if _under_ci():
        raise RuntimeError(
            "headless Chromium tests need the chromium and chromium-driver packages and selenium "
            "(.ci/run installs them); missing under CI"
        )
    return None


def start_chromium(browser: str, driver: str, width: int = 1280, height: int = 900) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))
