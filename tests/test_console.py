"""The console (`GET /` on the admin port) in a real headless Chromium, against a real gateway
process, real Redis and a real upstream: it loads, shows a burst of refusals within seconds, edits
an override through the admin API with the admin token, and fetches nothing from another host.

`CONSOLE_SCREENSHOT=/tmp/console.png pytest tests/test_console.py -k burst` saves the page as the
burst left it (docs/console.png is the same page after a minute of mixed traffic)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.support.gateway_proc import GatewayProcess
from tests.support.patience import within
from tests.support.redis_proc import RedisProcess
from tests.support.upstream import Upstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

TOKEN = "console-test-token"
CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
admin: {{token: {token}}}
upstreams:
  up: {{url: "{upstream}"}}
routes:
  - name: api
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: user, by: ["header:X-User-Id"], algorithm: fixed_window, limit: 2, window: 1h}}
      - {{name: everyone, by: [], algorithm: fixed_window, limit: 100000, window: 1h}}
"""
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000")


@pytest.fixture
def gateway(tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream) -> Iterator[GatewayProcess]:
    text = CONFIG.format(prefix=f"c{uuid.uuid4().hex[:8]}", token=TOKEN, upstream=upstream.url)
    process = GatewayProcess(text, tmp_path, redis_url=redis_proc.url, workers=2)
    process.start()
    yield process
    process.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(within(30))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], Any], seconds: float = 15.0) -> Any:
    """Until the page's DOM meets `condition` (checked every 100 ms). The page redraws live, so an
    element found may be replaced before it is read: that check is simply made again."""
    return WebDriverWait(driver, within(seconds), poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(condition)


def refused_peak(driver: WebDriver, route: str) -> float:
    found = driver.find_elements(By.CSS_SELECTOR, f'[data-route="{route}"] > h3 .rate')
    return float(found[0].get_attribute("data-refused-peak") or 0) if found else 0.0


def test_the_page_loads_with_the_routes_and_a_burst_of_refusals_shows_within_seconds(
        gateway: GatewayProcess, browser: WebDriver) -> None:
    browser.get(gateway.admin_url + "/")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-route="api"] [data-rule="user"]'))
    assert browser.find_element(By.ID, "breaker").text == "breaker closed"
    assert refused_peak(browser, "api") == 0
    assert "nobody refused" in browser.find_element(By.ID, "top").text

    abuser = f"mallory-{uuid.uuid4().hex[:6]}"
    token = abuser  # a user id, no secret: /top names it as it came
    with httpx.Client(base_url=gateway.url) as client:
        statuses = [client.get("/echo/x", headers={"X-User-Id": abuser}).status_code for _ in range(30)]
    assert statuses.count(429) == 28

    # both workers served the burst: the page's numbers are all of them together
    wait_for(browser, lambda d: refused_peak(d, "api") > 0)

    def top_row(d: WebDriver) -> list[str]:
        rows = d.find_elements(By.CSS_SELECTOR, f'#top tr[data-identity="{token}"]')
        return rows[0].text.split()[1:4] if rows else []

    wait_for(browser, lambda d: top_row(d) == ["api", "user", "28"])  # both workers' refusals counted
    rule_rates = '[data-route="api"] [data-rule="user"] .rate'  # found again at each check: the page redraws
    wait_for(browser, lambda d: float(d.find_element(By.CSS_SELECTOR, rule_rates).get_attribute("data-refused-peak")
                                      or 0) > 0)
    assert "config loaded" in browser.find_element(By.ID, "reload").text
    if path := os.environ.get("CONSOLE_SCREENSHOT"):
        browser.save_screenshot(path)


def test_an_override_set_in_the_page_applies_to_the_next_request(
        gateway: GatewayProcess, browser: WebDriver) -> None:
    user = f"alice-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=gateway.url) as client:
        assert [client.get("/echo/x", headers={"X-User-Id": user}).status_code for _ in range(3)] == [200, 200, 429]

    browser.get(gateway.admin_url + "/")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#override-rule option[value="api/user"]'))
    Select(browser.find_element(By.ID, "override-rule")).select_by_value("api/user")
    browser.find_element(By.ID, "override-key").send_keys(user)
    browser.find_element(By.ID, "override-body").send_keys('{"limit": 5, "window": "1h"}')

    # without the token the API's own check refuses it, and the page says so
    browser.find_element(By.CSS_SELECTOR, "#override-form button").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "override-result").text.startswith("401"))

    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#override-form button").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "override-result").text.startswith("set:"))
    listed = user  # /overrides lists a user id as it came
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#overrides tr[data-key="{listed}"]'))

    def applied() -> bool:
        found = httpx.get(f"{gateway.admin_url}/limits/api/user", params={"key": user}).json()
        return bool(found.get("override") == "numbers")

    wait_until(applied, timeout=10)  # stored: the admin's worker reads it
    with httpx.Client(base_url=gateway.url) as client:
        def admitted() -> bool:  # until both workers have read it (within 2 s); a refusal spends nothing
            return client.get("/echo/x", headers={"X-User-Id": user}).status_code == 200

        wait_until(admitted, timeout=10)
        answers = [client.get("/echo/x", headers={"X-User-Id": user}) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]  # 5 now: 2 spent before, 3 more


def test_the_page_fetches_nothing_from_another_host(gateway: GatewayProcess, browser: webdriver.Chrome) -> None:
    answer = httpx.get(gateway.admin_url + "/")
    policy = answer.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "http" not in policy  # no other origin allowed anywhere in it

    browser.get(gateway.admin_url + "/")
    wait_for(browser, lambda d: int(d.find_element(By.TAG_NAME, "body").get_attribute("data-samples") or 0) >= 2)
    fetched = browser.execute_script(
        "return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]")
    assert len(fetched) > 5  # the script, the style and the JSON endpoints
    assert all(url.startswith(gateway.admin_url + "/") for url in fetched), fetched
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]  # type: ignore[no-untyped-call]
    assert errors == []  # nothing the policy blocked, no script error


KEYS_CONFIG = """
version: 1
redis: {{timeout: 500ms, key_prefix: {prefix}}}
admin: {{token: {token}}}
keys: {{source: "header:X-Api-Key", unknown: reject, plans: [free, pro]}}
upstreams:
  up: {{url: "{upstream}"}}
routes:
  - name: api
    match: {{path: "/echo/{{rest:path}}"}}
    upstream: up
    limits:
      - {{name: per-key, by: ["header:X-Api-Key"], algorithm: fixed_window, limit: 100, window: 1h}}
"""


def test_a_key_registered_in_the_page_is_let_in_and_one_deleted_is_not(
        tmp_path: Path, redis_proc: RedisProcess, upstream: Upstream, browser: WebDriver) -> None:
    text = KEYS_CONFIG.format(prefix=f"c{uuid.uuid4().hex[:8]}", token=TOKEN, upstream=upstream.url)
    gateway = GatewayProcess(text, tmp_path, redis_url=redis_proc.url)
    gateway.start()
    try:
        key = "key-" + uuid.uuid4().hex
        assert httpx.get(f"{gateway.url}/echo/x", headers={"X-Api-Key": key}).status_code == 401
        browser.get(gateway.admin_url + "/")
        wait_for(browser, lambda d: d.find_element(By.ID, "keys-section").is_displayed())
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "key-value").send_keys(key)
        Select(browser.find_element(By.ID, "key-plan")).select_by_value("pro")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(browser, lambda d: "on plan pro" in d.find_element(By.ID, "key-result").text)
        fingerprint = browser.find_element(By.ID, "key-result").text.split()[0]
        assert fingerprint.startswith("kf_") and key not in browser.page_source  # the key itself is never shown
        wait_until(lambda: httpx.get(f"{gateway.url}/echo/x", headers={"X-Api-Key": key}).status_code == 200,
                   timeout=10)  # every worker reads the change within a second or two

        row = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#keys tr[data-key="{fingerprint}"]'))
        row[0].find_element(By.TAG_NAME, "button").click()
        wait_for(browser, lambda d: d.find_element(By.ID, "key-result").text == f"deleted {fingerprint}")
        wait_until(lambda: httpx.get(f"{gateway.url}/echo/x", headers={"X-Api-Key": key}).status_code == 401,
                   timeout=10)
    finally:
        gateway.stop()


def test_a_refused_reload_and_its_errors_show_on_the_page(gateway: GatewayProcess, browser: WebDriver) -> None:
    browser.get(gateway.admin_url + "/")
    errors = browser.find_element(By.ID, "reload-errors")
    wait_for(browser, lambda d: "config loaded" in d.find_element(By.ID, "reload").text)
    assert not errors.is_displayed()

    gateway.config_path.write_text(gateway.config_path.read_text().replace("limit: 2,", "limit: -2,"))
    answer = httpx.post(gateway.admin_url + "/reload", headers={"authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 422
    # whichever of the two workers answers the page knows
    wait_for(browser, lambda d: errors.is_displayed() and "limit" in errors.text)
    assert "reload refused" in browser.find_element(By.ID, "reload").text
    assert httpx.get(gateway.url + "/echo/x", headers={"X-User-Id": "z"}).status_code == 200  # the old config serves
