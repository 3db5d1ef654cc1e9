"""The network helpers every server shares (torchrl_oni.net): loopback checks and AppThread."""
import asyncio
import socket
import urllib.request

import pytest
from aiohttp import web

from torchrl_oni.net import AppThread, check_exposure, free_port, is_loopback


# ---------------------------------------------------------------------------------------------
# is_loopback / check_exposure
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.0.0.5", "gpu-node", "localhost.evil.example",
                                  "127.0.0.1.nip.io"])
def test_reachable_addresses(host):
    assert not is_loopback(host)


# The two copies this function replaces disagreed on these: the embedded server's took any case
# and trailing dot and stripped spaces, the labelling page's took only the exact "localhost".
@pytest.mark.parametrize("host", ["LOCALHOST", "LocalHost"])
def test_localhost_in_any_case_is_loopback(host):
    # Host names are case-insensitive: every spelling resolves to the loopback.
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["localhost.", "LOCALHOST."])
def test_absolute_localhost_is_not_trusted(host):
    # An absolute name may go to DNS instead of /etc/hosts: it is not known to be loopback.
    assert not is_loopback(host)


@pytest.mark.parametrize("host", [" 127.0.0.1", "127.0.0.1 ", " localhost", "::1\n"])
def test_text_around_an_address_is_not_loopback(host):
    assert not is_loopback(host)


def test_check_exposure_refuses_a_reachable_host_without_a_key():
    check_exposure("127.0.0.1", None)
    check_exposure("LOCALHOST", None)
    check_exposure("0.0.0.0", "key")
    check_exposure("0.0.0.0", None, insecure_no_auth=True)
    for host in ("0.0.0.0", "", "localhost."):
        with pytest.raises(ValueError, match="without an API key"):
            check_exposure(host, None)


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ---------------------------------------------------------------------------------------------
# AppThread
# ---------------------------------------------------------------------------------------------
def _hello_app():
    async def hello(request):
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    return app


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


def test_app_thread_serves_stops_and_comes_back_on_the_same_port():
    served = AppThread(_hello_app, port=0, reuse_address=True).start()
    try:
        port = served.port
        assert port != 0 and served.running and served.url == f"http://127.0.0.1:{port}"
        assert _get(served.url + "/") == b"hello"
        served.stop()
        assert not served.running
        with pytest.raises(OSError):
            _get(served.url + "/")
        served.start()
        assert served.port == port and _get(served.url + "/") == b"hello"
    finally:
        served.stop()
    served.stop()  # twice is fine


def test_app_thread_reports_a_port_in_use():
    with AppThread(_hello_app, port=0) as first:
        with pytest.raises(OSError):
            AppThread(_hello_app, port=first.port).start()
        assert first.running


def test_app_thread_runs_and_cancels_background_jobs():
    seen = []

    async def job(runner):
        seen.append(isinstance(runner, web.AppRunner))
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    with AppThread(_hello_app, port=0, background=[job]):
        pass
    assert seen == [True, "cancelled"]


def test_app_thread_url_of_other_hosts():
    assert AppThread(_hello_app, "0.0.0.0", 8000).url == "http://127.0.0.1:8000"
    assert AppThread(_hello_app, "::1", 8000).url == "http://[::1]:8000"
