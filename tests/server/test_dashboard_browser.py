"""Issue 19, acceptance 1: /dashboard in a real browser (Debian's chromium through WebDriver), against
a live `kvtier serve` with G2, G3 and G4 (a real Redis) and an API key, while it serves traffic.

Oracle: the server's own /v1/kv/stats. Once the traffic has stopped and the counters are still,
every per-tier number the page shows (its `data-v` attributes) must equal the endpoint's. The
screenshot goes to $KVTIER_TEST_ARTIFACTS (default: test-artifacts/ in the checkout).

Slow (`make test-all`): it installs chromium and chromium-driver with apt-get when they are missing."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checkpoints import random_prompt
from serving import REPO, start_server

sys.path.insert(0, str(Path(__file__).parents[1] / "remote"))
from redis_procs import SERVER as REDIS_SERVER, RedisProc, free_port  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "dash-key"
SHARED = random_prompt(200, 6999)
AUTH = {"Authorization": f"Bearer {KEY}"}
ARTIFACTS = Path(os.environ.get("KVTIER_TEST_ARTIFACTS", REPO / "test-artifacts"))


def ensure_chromium() -> tuple[str, str]:
    """(chromium, chromedriver) paths, installing Debian's packages when they are missing."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        cmd = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
        if os.geteuid() != 0:
            cmd = ["sudo", "-n", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                           check=False, timeout=900)
        if r.returncode != 0:
            pytest.fail(f"cannot install chromium ({' '.join(cmd)}): {r.stderr[-2000:]}")
    return shutil.which("chromium"), shutil.which("chromedriver")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.fail("redis-server/valkey-server is not installed (make test installs it)")
    r = RedisProc(tmp_path_factory.mktemp("redis"), free_port()).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def srv(ckpt_dir, redis, tmp_path_factory):
    g3 = tmp_path_factory.mktemp("g3")
    s = start_server(str(ckpt_dir("llama")), "--api-key", KEY, "--num-gpu-blocks", "64", "--kv-offloading-size", "0.002",
                     "--kv-offload-disk", str(g3), "--kv-offload-disk-size", "0.01", "--kv-offload-remote", redis.url, "--kv-offload-remote-trusted",
                     "--disable-log-stats")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = ensure_chromium()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1700"):
        opts.add_argument(a)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    yield b
    b.quit()


class Traffic:
    """Requests in a loop on a thread: prompts that come back (prefix hits in every tier), and
    floods that push them down the tiers."""

    def __init__(self, srv) -> None:
        self.srv, self.stop, self.sent, self.errors = srv, threading.Event(), 0, []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with self.srv.client(headers=AUTH) as c:
            i = 0
            while not self.stop.is_set():
                if i % 3 == 0:  # a shared system prompt: G1 hits
                    prompt = SHARED + random_prompt(100, 9000 + i)
                elif i % 3 == 1:  # a flood that pushes older prompts out of G1 and G2
                    prompt = random_prompt(500, 8000 + i)
                else:  # one of three prompts that come back after floods: lower-tier hits
                    prompt = random_prompt(300, 7000 + (i // 3) % 3)
                r = c.post("/v1/completions", json={"model": self.srv.model, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0, "ignore_eos": True})
                if r.status_code != 200:
                    self.errors.append(r.text)
                self.sent += 1
                i += 1


def page_values(browser) -> dict[str, float | None]:
    """Every number the page shows with its name, read in one script run (the page re-renders its
    panels on each refresh, so element handles go stale)."""
    got = browser.execute_script("return [...document.querySelectorAll('[data-k]')].map(e => [e.dataset.k, "
                                 "e.dataset.v === undefined ? e.textContent : e.dataset.v])")
    out: dict[str, float | None] = {}
    for k, v in got:
        try:
            out[k] = float(v)
        except (TypeError, ValueError):  # "-": nothing to show yet
            out[k] = None
    return out


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_dashboard_shows_live_tier_numbers_equal_to_kv_stats(srv, browser):
    from selenium.webdriver.common.by import By

    traffic = Traffic(srv)
    traffic.thread.start()
    try:
        browser.get(srv.url + "/dashboard")
        status = browser.find_element(By.ID, "status")
        wait(lambda: "API key" in status.text, 20, "the page to say it needs the key")  # /v1/kv/stats said 401
        browser.find_element(By.ID, "apikey").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#keyform button").click()
        wait(lambda: status.text == "ok", 20, "the page to load with the key")
        start = int(browser.find_element(By.ID, "updates").text)
        # Live: the numbers move between refreshes while traffic flows.
        first = page_values(browser)
        wait(lambda: int(browser.find_element(By.ID, "updates").text) >= start + 3, 30, "three refreshes")
        moved = page_values(browser)
        assert moved["engine.prompt_tokens"] > first["engine.prompt_tokens"], "the page did not update"
        assert browser.find_element(By.ID, "apikey").get_attribute("value") == "", "the key stayed in the DOM"
    finally:
        traffic.stop.set()
        traffic.thread.join(120)
    assert not traffic.errors, traffic.errors[:3]
    assert traffic.sent >= 6

    with srv.client(headers=AUTH) as c:
        def still() -> dict | None:  # two equal snapshots a refresh apart: writes have drained
            a = c.get("/v1/kv/stats").json()
            time.sleep(2)
            b = c.get("/v1/kv/stats").json()
            return b if a == b else None

        stats = wait(still, 60, "the tiers to go still")
    n = int(browser.find_element(By.ID, "updates").text)
    wait(lambda: int(browser.find_element(By.ID, "updates").text) >= n + 2, 30, "two refreshes after the traffic")
    shown = page_values(browser)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    tiers = stats["tiers"]
    assert set(tiers) == {"G1", "G2", "G3", "G4"}, set(tiers)
    panels = set(browser.execute_script("return [...document.querySelectorAll('[data-tier]')].map(e => e.dataset.tier)"))
    assert panels == set(tiers)
    g1 = tiers["G1"]
    assert shown["G1.hit_tokens"] == g1["prefix_cache_hits"] > 0
    assert shown["G1.miss_tokens"] == g1["prefix_cache_queries"] - g1["prefix_cache_hits"]
    assert shown["G1.evictions"] == g1["evictions"]
    assert shown["G1.occupancy"] == pytest.approx(g1["usage"])
    for name in ("G2", "G3", "G4"):
        t = tiers[name]
        assert shown[f"{name}.hit_tokens"] == t["hit_tokens"], name
        assert shown[f"{name}.miss_tokens"] == t["miss_tokens"], name
        assert shown[f"{name}.bytes_in"] == t.get("bytes_in", t.get("bytes_written")) > 0, name
        assert shown[f"{name}.bytes_out"] == t.get("bytes_out", t.get("bytes_read")), name
        assert shown[f"{name}.evictions"] == t.get("evictions", 0), name
        assert shown[f"{name}.corrupt"] == t.get("corrupt", 0), name
    assert shown["G2.occupancy"] == pytest.approx(tiers["G2"]["blocks"] / tiers["G2"]["capacity_blocks"])
    assert shown["G3.occupancy"] == pytest.approx(tiers["G3"]["used_bytes"] / tiers["G3"]["capacity_bytes"])
    assert sum(tiers[t]["hit_tokens"] for t in ("G2", "G3", "G4")) > 0, "no lower-tier hit: the test's traffic is wrong"
    r = stats["requests"]
    assert shown["requests.running"] == r["running"] == 0 and shown["requests.waiting"] == r["waiting"] == 0
    assert shown["engine.prompt_tokens"] == r["prompt_tokens"] and shown["engine.generation_tokens"] == r["generation_tokens"]
    assert shown["latency.ttft_p50"] is not None and shown["latency.ttft_p50"] > 0
    assert shown["sources.local_compute"] > 0 and shown["sources.local_cache_hit"] > 0


def test_dashboard_page_is_open_but_its_data_needs_the_key(srv):
    with srv.client() as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and "kvtier dashboard" in page.text
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert "<script src" not in page.text and "https://" not in page.text  # self-contained: no CDN
        assert c.get("/v1/kv/stats").status_code == 401 and c.get("/metrics").status_code == 401
