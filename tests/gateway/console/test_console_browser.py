"""The console in a real browser (headless Chromium, Selenium): refused without the admin key, open
with it; a key created there works on the API and stops working once revoked there; a bad policy
edit shows its error and changes nothing. Skipped without Chromium, except under CI."""

from __future__ import annotations

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.console.support import POLICY, console_files
from tests.support.browser import chromium_paths, start_chromium
from tests.support.servers import ServerThread


@pytest.fixture(scope="module")
def browser():
    paths = chromium_paths()
    if paths is None:
        pytest.skip("headless Chromium (apt: chromium chromium-driver) or selenium is not installed")
    driver = start_chromium(*paths)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    files = console_files(tmp_path_factory.mktemp("browser"))
    settings = GatewaySettings(
        keys_file=files.keys_file,
        policy_dir=files.policy_dir,
        admin_key_file=files.admin_key_file,
        default_policy="console-test",
    )
    with ServerThread(create_app(settings, engine=engine)) as running:
        running.files = files
        yield running


def _by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def _follow(driver, element) -> None:
    """Click a link or a form's button and wait for the page it leads to: a click can return before
    the next document has replaced the current one (a loaded machine answers the POST late)."""
    from selenium.webdriver.support.ui import WebDriverWait

    element.click()
    wait = WebDriverWait(driver, 60)
    wait.until(lambda _driver: _left_the_document(element))
    wait.until(lambda d: d.execute_script("return document.readyState") == "complete")


def _left_the_document(element) -> bool:
    """Whether the element's document has been replaced. Chromium reports a node of a document that
    is being replaced either as stale or, mid-swap, as a node that "does not belong to the
    document"; both mean the page moved on."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as error:
        if "does not belong to the document" in str(error.msg):
            return True
        raise
    return False


def _log_in(driver, url: str, key: str) -> None:
    driver.delete_all_cookies()  # a fresh login, whatever the test before left
    driver.get(f"{url}/console")
    _by_css(driver, "#admin_key").send_keys(key)
    _follow(driver, _by_css(driver, "#login"))


def _models_status(url: str, key: str) -> int:
    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_refused_without_the_admin_key_open_with_it(browser, server):
    files = server.files
    browser.delete_all_cookies()
    browser.get(f"{server.url}/console/savings")
    assert browser.current_url.endswith("/console/login")
    _log_in(browser, server.url, files.tenant_key)  # a tenant key is not the admin key
    assert "Wrong admin key" in _by_css(browser, "#login-error").text
    assert browser.current_url.endswith("/console/login")
    _log_in(browser, server.url, files.admin_key)
    assert browser.current_url.endswith("/console")
    assert "acme" in _by_css(browser, "#tenant-acme h2").text
    assert browser.get_cookie("ctxgate_console")["httpOnly"] is True


def test_a_key_created_in_the_console_works_and_stops_once_revoked(browser, server):
    files = server.files
    _log_in(browser, server.url, files.admin_key)
    _by_css(browser, "#create-tenant").send_keys("browser-tenant")
    _by_css(browser, "#create-policy").send_keys("console-test")
    _follow(browser, _by_css(browser, "#create"))
    key = _by_css(browser, "#new-key").text.strip()
    assert key.startswith("cg-")
    assert _models_status(server.url, key) == 200

    _follow(browser, _by_css(browser, "#back"))
    row = _by_css(browser, "#tenant-browser-tenant tr.key.active")
    _follow(browser, row.find_element("css selector", "button.revoke"))
    assert "Revoked key" in _by_css(browser, "#message").text
    assert _models_status(server.url, key) == 401
    browser.get(f"{server.url}/console")
    assert _by_css(browser, "#tenant-browser-tenant tr.key .status").text == "revoked"


def test_a_bad_policy_edit_shows_its_error_and_changes_nothing(browser, server):
    files = server.files
    _log_in(browser, server.url, files.admin_key)
    browser.get(f"{server.url}/console/policies")
    _follow(browser, browser.find_element("link text", "Edit"))
    area = _by_css(browser, "#policy-text")
    area.clear()
    area.send_keys(POLICY.replace("max_input_tokens: 220", "max_input_tokens: lots"))
    _follow(browser, _by_css(browser, "#save-policy"))
    error = _by_css(browser, "#policy-error").text
    assert "field 'max_input_tokens'" in error
    assert (files.policy_dir / "console-test.yaml").read_text() == POLICY
    listed = httpx.get(
        f"{server.url}/v1/ctxgate/policies", headers={"Authorization": f"Bearer {files.tenant_key}"}
    ).json()
    (policy,) = [item for item in listed["policies"] if item["name"] == "console-test"]
    assert policy["effective"]["max_input_tokens"] == 220


def test_without_chromium_the_browser_tests_skip_here_and_fail_under_ci(monkeypatch, tmp_path):
    missing = {"names": ("no-such-chromium",), "chromedriver": str(tmp_path / "chromedriver")}
    monkeypatch.delenv("CI", raising=False)
    assert chromium_paths(**missing) is None
    monkeypatch.setenv("CI", "true")
    with pytest.raises(RuntimeError, match="chromium-driver"):
        chromium_paths(**missing)
