"""Fixtures shared by the test modules; plain helper functions are in ``tests/helpers.py``."""
import os
import shutil
import sys
import tempfile

import pytest

# ``from helpers import ...`` works in every import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's, driven by selenium through /usr/bin/chromedriver), one per module.

    Skips the test, saying why, when selenium, chromium or chromedriver is missing or the browser
    cannot start here; quits the browser and removes its profile afterwards.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else shutil.which("chromedriver")
    if not binary or not driver_path:
        pytest.skip("chromium / chromedriver are not installed (apt-get install -y chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="oni-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1280,1000"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as err:  # a browser that cannot start here is an environment problem
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"headless chromium did not start: {type(err).__name__}: {str(err).splitlines()[0]}")
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def scripted():
    """An embedded OpenAI-compatible server (oni-serve) with the scripted backend, on a free port."""
    from torchrl_oni.serve.embedded import start_embedded_server

    with start_embedded_server(backend="scripted", port=0) as server:
        yield server
