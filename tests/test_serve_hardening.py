"""oni-serve against hostile or careless clients, over real HTTP (and raw sockets): API keys,
the bounded queue, work of disconnected clients, read timeouts, size limits, field validation,
and the vLLM launcher's process lifecycle (against a fake ``vllm`` that sleeps before listening).

Model-dependent checks (token limits, aborting a running batch) are in ``test_serve.py`` beside
its model fixture.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import aiohttp
import pytest

from helpers import one_error_line, poll, run_cli
from torchrl_oni.serve.embedded import ServerHandle, start_embedded_server
from torchrl_oni.serve.engines import Completion, ScriptedEngine
from torchrl_oni.serve.http import OpenAIServer

KEY = "s3cret-key"
PROMPT = "Message: <message>You kill the newt!</message>\nProgress:"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
async def _send(session, method, url, body=None, key=None, timeout=10.0, raw=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    async with session.request(method, url, data=data, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        text = await resp.text()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = text
        return resp.status, resp.headers, payload


def _call(method, url, body=None, key=None, raw=None):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await _send(session, method, url, body, key, raw=raw)

    return asyncio.run(go())


def _health(server):
    return _call("GET", server.url.replace("/v1", "/health"))[2]


def _assert_openai_error(status, payload, want_status, param=None, code=None):
    assert status == want_status, payload
    err = payload["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if want_status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


class GatedEngine(ScriptedEngine):
    """Scripted answers, but each engine call waits for ``gate``; like the model engine between
    steps, it gives up early once ``alive`` says nobody waits for any of its prompts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = []
        self.aborted_calls = 0

    def complete(self, prompts, alive=None, **kw):
        self.calls.append(list(prompts))
        self.entered.set()
        while not self.gate.wait(0.01):
            if alive is not None and not any(alive()):
                self.aborted_calls += 1
                return [Completion(text="", finish_reason="abort") for _ in prompts]
        return super().complete(prompts, alive=alive, **kw)


@contextmanager
def _serve(engine=None, **kw):
    handle = ServerHandle(OpenAIServer(engine or ScriptedEngine(), **kw), port=0).start()
    try:
        yield handle
    finally:
        if isinstance(engine, GatedEngine):
            engine.gate.set()  # lets a blocked engine call finish so the server can stop
        handle.stop()


# ---------------------------------------------------------------------------------------------
# API key
# ---------------------------------------------------------------------------------------------
def test_api_key_guards_every_route_but_health():
    with _serve(api_key=KEY) as server:
        status, headers, body = _call("GET", server.url + "/models")
        _assert_openai_error(status, body, 401, code="invalid_api_key")
        assert "no API key" in body["error"]["message"]
        assert headers["WWW-Authenticate"] == "Bearer"
        status, _, body = _call("GET", server.url + "/models", key="wrong")
        _assert_openai_error(status, body, 401, code="invalid_api_key")
        assert "incorrect API key" in body["error"]["message"]
        status, _, body = _call("POST", server.url + "/completions", {"prompt": PROMPT})
        _assert_openai_error(status, body, 401, code="invalid_api_key")
        status, _, body = _call("POST", server.url + "/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]}, key="Bearer")
        _assert_openai_error(status, body, 401, code="invalid_api_key")
        assert _health(server)["requests"] == 0  # refused before any work
        status, _, body = _call("GET", server.url + "/models", key=KEY)
        assert status == 200 and body["data"][0]["id"] == "scripted"
        status, _, body = _call("POST", server.url + "/completions",
                                {"prompt": PROMPT, "max_tokens": 1}, key=KEY)
        assert status == 200 and body["choices"][0]["text"] == "yes"


def test_openai_client_sends_the_key_and_reports_a_wrong_one():
    openai = pytest.importorskip("openai")
    with _serve(api_key=KEY) as server:
        good = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        out = good.completions.create(model="scripted", prompt=[PROMPT], max_tokens=1)
        assert out.choices[0].text == "yes"
        bad = openai.OpenAI(base_url=server.url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_reachable_address_needs_a_key_or_an_explicit_opt_out():
    with pytest.raises(ValueError, match="without an API key"):
        start_embedded_server(backend="scripted", host="0.0.0.0")
    with pytest.raises(ValueError, match="without an API key"):
        ServerHandle(OpenAIServer(ScriptedEngine()), host="")
    with start_embedded_server(backend="scripted", host="0.0.0.0", api_key=KEY) as server:
        assert _call("GET", server.url + "/models", key=KEY)[0] == 200
    with start_embedded_server(backend="scripted", host="0.0.0.0", insecure_no_auth=True) as server:
        assert _call("GET", server.url + "/models")[0] == 200
    with start_embedded_server(backend="scripted", host="localhost") as server:
        assert _call("GET", server.url + "/models")[0] == 200


# ---------------------------------------------------------------------------------------------
# browsers: Host (DNS rebinding) and cross-site POSTs
# ---------------------------------------------------------------------------------------------
async def _request_with(url, method="GET", headers=None, data=None):
    """``(status, payload)`` of one request with exactly these headers (aiohttp adds Host only
    when it is not given)."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, headers=headers or {}, data=data,
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


def _with(url, method="GET", headers=None, data=None):
    return asyncio.run(_request_with(url, method, headers, data))


BODY = json.dumps({"prompt": PROMPT, "max_tokens": 1})
JSON = {"Content-Type": "application/json"}


def test_without_a_key_foreign_host_headers_are_refused_on_every_route():
    """DNS rebinding: a page on attacker.example re-points its name at 127.0.0.1 and becomes a
    same-origin client of the port; its requests still say Host: attacker.example."""
    with _serve() as server:
        port = server.port
        for path, method, data in (("/v1/models", "GET", None), ("/health", "GET", None),
                                   ("/v1/completions", "POST", BODY),
                                   ("/v1/chat/completions", "POST", json.dumps({"messages": [
                                       {"role": "user", "content": "hi"}]}))):
            url = f"http://127.0.0.1:{port}{path}"
            status, body = _with(url, method, {"Host": f"attacker.example:{port}", **JSON}, data)
            _assert_openai_error(status, body, 403, code="host_not_allowed")
            assert "attacker.example" in body["error"]["message"] and "--allowed-host" in body["error"]["message"]
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
                assert _with(url, method, {"Host": host, **JSON}, data)[0] == 200, (path, host)
        assert _health(server)["requests"] == 8  # 4 loopback Hosts x 2 POST routes: refusals did no work


def test_posts_must_be_json_from_the_same_origin_key_or_no_key():
    for kw, auth in (({}, {}), ({"api_key": KEY}, {"Authorization": f"Bearer {KEY}"})):
        with _serve(**kw) as server:
            url = server.url + "/completions"
            for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                status, body = _with(url, "POST", {"Content-Type": kind, **auth}, BODY)
                _assert_openai_error(status, body, 415, code="unsupported_media_type")
            status, body = _with(url, "POST", auth, BODY.encode())  # no Content-Type at all
            _assert_openai_error(status, body, 415)
            status, body = _with(url, "POST", {"Origin": "http://attacker.example", **JSON, **auth}, BODY)
            _assert_openai_error(status, body, 403, code="cross_origin")
            assert _health(server)["requests"] == 0
            same = f"http://127.0.0.1:{server.port}"
            assert _with(url, "POST", {"Origin": same, **JSON, **auth}, BODY)[0] == 200
            assert _with(url, "POST", {"Content-Type": "application/json; charset=utf-8", **auth}, BODY)[0] == 200


def test_with_a_key_any_host_name_reaches_the_server_unless_names_are_configured():
    # the key is the gate: clients may name the server as they like (gpu-node, an IP, a tunnel)
    with start_embedded_server(backend="scripted", host="0.0.0.0", api_key=KEY) as server:
        url = server.url + "/models"
        auth = {"Authorization": f"Bearer {KEY}"}
        assert _with(url, headers={"Host": "gpu-node:8000", **auth})[0] == 200
        assert _with(url, headers={"Host": "gpu-node:8000"})[0] == 401
    with start_embedded_server(backend="scripted", host="0.0.0.0", api_key=KEY,
                               allowed_hosts=["gpu-node"]) as server:
        url = server.url + "/models"
        assert _with(url, headers={"Host": "gpu-node:8000", **auth})[0] == 200
        assert _with(url, headers={"Host": "other-node:8000", **auth})[0] == 403


def test_without_a_key_the_bound_address_and_allowed_names_are_accepted():
    with start_embedded_server(backend="scripted", host="0.0.0.0", insecure_no_auth=True,
                               allowed_hosts=["gpu-node", "10.1.2.3"]) as server:
        url = server.url + "/models"
        for host, status in (("gpu-node:8000", 200), ("GPU-NODE", 200), ("10.1.2.3:8000", 200),
                             ("0.0.0.0:8000", 403), ("attacker.example", 403)):
            assert _with(url, headers={"Host": host})[0] == status, host
    with start_embedded_server(backend="scripted", host="0.0.0.0", insecure_no_auth=True,
                               allowed_hosts=["*"]) as server:
        assert _with(server.url + "/models", headers={"Host": "anything.example"})[0] == 200


def test_cli_allowed_host_reaches_the_server():
    proc = subprocess.Popen([sys.executable, "-m", "torchrl_oni.serve", "--backend", "scripted",
                             "--port", "0", "--allowed-host", "gpu-node"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_cli_env())
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if not url else url
        assert _with(url + "/models", headers={"Host": "gpu-node"})[0] == 200
        assert _with(url + "/models", headers={"Host": "attacker.example"})[0] == 403
        assert _with(url + "/completions", "POST", {"Content-Type": "text/plain"}, BODY)[0] == 415
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# queue bound and disconnected clients
# ---------------------------------------------------------------------------------------------
def test_full_queue_answers_503_with_retry_after():
    engine = GatedEngine()
    with _serve(engine, max_queue=2) as server:
        url = server.url + "/completions"

        async def go():
            async with aiohttp.ClientSession() as session:
                def post(text):
                    return asyncio.create_task(_send(session, "POST", url, {"prompt": text,
                                                                           "max_tokens": 1}))
                first = post("You kill the newt!")
                assert await asyncio.to_thread(engine.entered.wait, 5)
                queued = [post("It's a wall."), post("You see here 3 gold pieces.")]
                assert await asyncio.to_thread(poll, lambda: _health(server)["queued"] == 2)
                status, headers, body = await _send(session, "POST", url, {"prompt": "late"})
                _assert_openai_error(status, body, 503, code="server_busy")
                assert int(headers["Retry-After"]) >= 1
                engine.gate.set()
                return [await t for t in [first] + queued]

        answers = asyncio.run(go())
        assert [(s, b["choices"][0]["text"]) for s, _, b in answers] == [
            (200, "yes"), (200, "no"), (200, "yes")]
        assert ["late"] not in engine.calls and _health(server)["busy"] == 1


def test_work_of_disconnected_clients_is_dropped():
    engine = GatedEngine()
    with _serve(engine, max_queue=8) as server:
        url = server.url + "/completions"

        async def go():
            async with aiohttp.ClientSession() as session:
                def post(text, timeout):
                    return asyncio.create_task(_send(session, "POST", url, {
                        "prompt": text, "max_tokens": 1}, timeout=timeout))
                running = post("A", 2.0)  # in the engine when its client gives up
                assert await asyncio.to_thread(engine.entered.wait, 5)
                waiting = [post("B", 0.5), post("C", 0.5)]  # queued behind A when they give up
                for task in [running] + waiting:
                    with pytest.raises(asyncio.TimeoutError):
                        await task
                # The server noticed: queue empty, the running call gave up without the gate.
                assert await asyncio.to_thread(
                    poll, lambda: _health(server)["cancelled"] == 3 and engine.aborted_calls == 1)
                assert (await asyncio.to_thread(_health, server))["queued"] == 0
                engine.gate.set()
                return await _send(session, "POST", url, {"prompt": PROMPT, "max_tokens": 1})

        status, _, body = asyncio.run(go())
        assert status == 200 and body["choices"][0]["text"] == "yes"
        assert engine.calls == [["A"], [PROMPT]]  # B and C never reached the engine
        assert _health(server)["aborted_prompts"] == 1


def test_stopping_the_server_answers_running_and_waiting_requests_503():
    engine = GatedEngine()
    server = ServerHandle(OpenAIServer(engine), port=0).start()
    url = server.url + "/completions"

    async def go():
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(_send(session, "POST", url, {"prompt": "A"}))
            assert await asyncio.to_thread(engine.entered.wait, 5)
            waiting = asyncio.create_task(_send(session, "POST", url, {"prompt": "B",
                                                                       "max_tokens": 3}))
            assert await asyncio.to_thread(poll, lambda: _health(server)["queued"] == 1)
            started = time.monotonic()
            await asyncio.to_thread(server.stop)  # the gate stays shut: only `alive` frees it
            return time.monotonic() - started, [await running, await waiting]

    try:
        seconds, answers = asyncio.run(go())
        # the engine thread, left running by the stop, gives up at its next check
        assert poll(lambda: engine.aborted_calls == 1)
    finally:
        engine.gate.set()
        server.stop()
    assert seconds < 5.0
    for status, _, body in answers:
        _assert_openai_error(status, body, 503)
        assert "shutting down" in body["error"]["message"]
    assert engine.calls == [["A"]]


# ---------------------------------------------------------------------------------------------
# read timeouts (raw sockets: a client that never finishes sending)
# ---------------------------------------------------------------------------------------------
def _connect(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return sock


def _closed_by_server(sock, trickle: bytes = b"", timeout=5.0) -> float:
    """Sends ``trickle`` one byte per 50 ms (then nothing) until the server closes; seconds."""
    start = time.monotonic()
    sock.settimeout(0.05)
    data = iter(trickle)
    while time.monotonic() - start < timeout:
        try:
            byte = next(data, None)
            if byte is not None:
                sock.send(bytes([byte]))
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except socket.timeout:
            continue
        except OSError:  # reset by the server
            return time.monotonic() - start
    raise AssertionError("the server kept the connection open")


def test_half_sent_request_heads_are_dropped():
    with _serve(read_timeout=0.5) as server:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        stalled = [_connect(server) for _ in range(20)]
        for sock in stalled:
            sock.sendall(head[:30])
        # Meanwhile others are served at once.
        status, _, body = _call("POST", server.url + "/completions", {"prompt": PROMPT})
        assert status == 200
        trickler = _connect(server)
        assert _closed_by_server(trickler, trickle=head * 10) < 3.0  # trickling does not help
        for sock in stalled:
            assert _closed_by_server(sock) < 3.0
            sock.close()
        trickler.close()


def test_half_sent_body_gets_408():
    with _serve(read_timeout=0.5) as server:
        sock = _connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        start = time.monotonic()
        sock.settimeout(5)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert 0.4 < time.monotonic() - start < 3.0
        assert reply.startswith(b"HTTP/1.1 408")
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "timeout" and "not received" in error["message"]
        assert _closed_by_server(sock) < 3.0
        sock.close()


def test_idle_keep_alive_connection_is_closed_after_the_read_timeout():
    with _serve(read_timeout=0.5) as server:
        sock = _connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert 0.3 < _closed_by_server(sock) < 3.0
        sock.close()


# ---------------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------------
def test_body_over_the_limit_is_413_with_or_without_content_length():
    limit = 64 * 1024
    with _serve(max_body_bytes=limit) as server:
        url = server.url + "/completions"
        big = json.dumps({"prompt": "x" * (2 * limit)})
        status, _, body = _call("POST", url, raw=big)
        _assert_openai_error(status, body, 413, code="request_too_large")
        assert str(limit) in body["error"]["message"]

        async def chunked():
            async def parts():
                for i in range(0, len(big), 8192):
                    yield big[i:i + 8192].encode()

            async with aiohttp.ClientSession() as session:
                async with session.post(url, data=parts(), headers={"Content-Type": "application/json"}) as resp:
                    return resp.status, await resp.json()

        status, body = asyncio.run(chunked())
        _assert_openai_error(status, body, 413, code="request_too_large")
        assert _health(server)["engine_calls"] == 0


def test_prompt_over_the_byte_limit_is_refused_before_the_engine():
    with _serve(max_prompt_bytes=1000) as server:
        status, _, body = _call("POST", server.url + "/completions",
                                {"prompt": ["short", "é" * 600]})  # 600 chars, 1200 bytes
        _assert_openai_error(status, body, 400, param="prompt", code="context_length_exceeded")
        assert "prompt 1 is 1200 bytes" in body["error"]["message"]
        status, _, body = _call("POST", server.url + "/chat/completions",
                                {"messages": [{"role": "user", "content": "y" * 1001}]})
        _assert_openai_error(status, body, 400, param="messages", code="context_length_exceeded")
        assert _health(server)["engine_calls"] == 0
        status, _, _ = _call("POST", server.url + "/completions", {"prompt": "é" * 400})
        assert status == 200


# ---------------------------------------------------------------------------------------------
# validation: nothing a client sends gives a 500
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route,raw,param,words", [
    ("completions", b'{"prompt": "x", "temperature": NaN}', "temperature", "finite"),
    ("completions", b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens", "finite"),
    ("completions", b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens", "finite"),
    ("completions", b'{"prompt": "x", "top_p": -Infinity}', "top_p", "finite"),
    ("completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}", "max_tokens",
     "between"),
    ("completions", b'{"prompt": "x", "temperature": 1e308}', "temperature", "between"),
    ("completions", b'{"prompt": "x", "logprobs": NaN}', "logprobs", "finite"),
    ("completions", b'{"prompt": "x", "max_tokens": 2.5}', "max_tokens", "integer"),
    ("completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens", "between"),
    ("completions", b'{"prompt": "x", "presence_penalty": 3}', "presence_penalty", "between"),
    ("completions", b'{"prompt": "x", "seed": 1.5}', "seed", "integer"),
    ("completions", b'{"prompt": "x", "n": 2}', "n", "n=1"),
    ("completions", b'{"prompt": "x", "stream": "yes"}', "stream", "true or false"),
    ("completions", b'{"prompt": "x", "stop": ' + json.dumps(["a"] * 17).encode() + b"}",
     "stop", "at most"),
    ("completions", b'{"prompt": "\\ud800"}', "prompt", "Unicode"),
    ("completions", b'{"prompt": "x", "stop": "\\udfff"}', "stop", "Unicode"),
    ("completions", b'{"model": ["scripted"], "prompt": "x"}', "model", "string"),
    ("completions", b"[" * 100_000, None, "JSON"),
    ("completions", b'{"prompt": "\xff\xfe"}', None, "UTF-8"),
    ("completions", b"", None, "JSON"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
                         b'"top_logprobs": NaN}', "top_logprobs", "finite"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                         b'"max_completion_tokens": Infinity}', "max_completion_tokens", "finite"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages",
     "Unicode"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": NaN}',
     "logprobs", "true or false"),
])
def test_bad_fields_are_400_naming_the_field(scripted, route, raw, param, words):
    status, _, body = _call("POST", f"{scripted.url}/{route}", raw=raw)
    _assert_openai_error(status, body, 400, param=param)
    assert words in body["error"]["message"]


def test_routing_errors_are_openai_json(scripted):
    status, _, body = _call("GET", scripted.url + "/nothing")
    _assert_openai_error(status, body, 404)
    status, _, body = _call("GET", scripted.url + "/completions")
    _assert_openai_error(status, body, 405)


def test_random_bodies_never_give_a_500(scripted):
    rng = random.Random(0)
    values = [None, True, False, -1, 0, 1, 2.5, 1e308, -1e308, 10 ** 30, "", "x", [], {}, ["x"],
              [1], [[]], {"a": 1}, "NaN", [None], "\ud800"]
    specials = ["NaN", "Infinity", "-Infinity", "1e999", "-0.0", "1" + "0" * 50]
    fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
              "top_p", "n", "best_of", "logprobs", "top_logprobs", "stop", "stream", "seed",
              "presence_penalty", "frequency_penalty"]

    def body():
        parts = [] if rng.random() < 0.2 else [
            '"prompt": "x"', '"messages": [{"role": "user", "content": "x"}]']
        for key in rng.sample(fields, rng.randint(1, 5)):
            value = (rng.choice(specials) if rng.random() < 0.3
                     else json.dumps(rng.choice(values)))
            parts.append(f'"{key}": {value}')
        return ("{" + ", ".join(parts) + "}").encode("utf-8", "surrogatepass")

    async def go():
        async with aiohttp.ClientSession() as session:
            out = []
            for i in range(300):
                route = "/completions" if i % 2 else "/chat/completions"
                out.append(await _send(session, "POST", scripted.url + route, raw=body()))
            return out

    statuses = [(s, b) for s, _, b in asyncio.run(go())]
    assert all(s < 500 for s, _ in statuses), [b for s, b in statuses if s >= 500][:3]
    assert {200, 400} <= {s for s, _ in statuses}
    assert all("error" in b for s, b in statuses if s >= 400)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _cli_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "ONI_SERVE_API_KEY"}
    env.update(extra)
    return env


def _cli(*args, env=None, timeout=60):
    return run_cli("torchrl_oni.serve", *args, env=env or _cli_env(), timeout=timeout)


def _one_error_line(proc):
    return one_error_line(proc, "oni-serve")


@pytest.mark.parametrize("args,env,words", [
    (["--backend", "scripted", "--host", "0.0.0.0"], {}, "without an API key"),
    (["--backend", "scripted", "--host", "::"], {}, "without an API key"),
    (["--backend", "scripted", "--api-key", "has space"], {}, "printable ASCII"),
    (["--backend", "scripted", "--api-key", ""], {}, "printable ASCII"),
    (["--backend", "scripted"], {"ONI_SERVE_API_KEY": "bad\tkey"}, "ONI_SERVE_API_KEY"),
    (["--backend", "scripted", "--read-timeout", "nan"], {}, "positive"),
    (["--backend", "scripted", "--max-queue", "0"], {}, "at least 1"),
    (["--backend", "scripted", "--max-body-mb", "-1"], {}, "positive"),
    (["--backend", "scripted", "--node-cache-mb", "-1"], {}, "--node-cache-mb: -1 must be a number >= 0"),
    (["--startup-timeout", "inf"], {}, "positive"),
    (["--backend", "vllm", "--model", "m", "--max-queue", "3"], {}, "--max-queue"),
    (["--backend", "scripted", "--vllm-command", "x"], {}, "--vllm-command"),
    (["--backend", "scripted", "--allowed-host", "http://x/"], {}, "not a host name"),
    (["--backend", "vllm", "--model", "m", "--vllm-command", "x", "--", "--api-key", "k"], {},
     "not after '--'"),
    (["--backend", "vllm", "--model", "m", "--vllm-command", "/nonexistent/vllm-server"], {},
     "cannot run"),
    (["--backend", "vllm", "--model", "m", "--vllm-command", "'unbalanced"], {}, "quotation"),
])
def test_cli_errors_are_one_line_exit_2(args, env, words):
    line = _one_error_line(_cli(*args, env=_cli_env(**env)))
    assert words in line


def test_cli_on_all_interfaces_with_env_key_serves_only_key_holders():
    proc = subprocess.Popen([sys.executable, "-m", "torchrl_oni.serve", "--backend", "scripted",
                             "--host", "0.0.0.0", "--port", "0", "--read-timeout", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_cli_env(ONI_SERVE_API_KEY=KEY))
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if not url else url
        assert _call("GET", url + "/models")[0] == 401
        assert _call("GET", url + "/models", key=KEY)[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert KEY not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_stops_cleanly_while_the_model_loads():
    from torchrl_oni.serve.models import TEST_MODEL, is_installed

    pytest.importorskip("transformers")
    if not is_installed(TEST_MODEL):
        pytest.skip(f"{TEST_MODEL} is not installed")
    proc = subprocess.Popen([sys.executable, "-m", "torchrl_oni.serve", "--model", TEST_MODEL,
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_cli_env())
    try:
        assert "loading" in proc.stderr.readline()  # signal handlers are in place by now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
        assert "stopped" in err and "Traceback" not in err and proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# vLLM launcher: the child never outlives oni-serve
# ---------------------------------------------------------------------------------------------
FAKE_VLLM = r'''
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

record, delay, exit_code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
argv = sys.argv[4:]
port = int(argv[argv.index("--port") + 1])
flag = "--served-model-name" if "--served-model-name" in argv else "--model"
name = argv[argv.index(flag) + 1]
key = os.environ.get("VLLM_API_KEY", "")
# like vLLM's engine/worker processes: a child in the same process group
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(record + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "worker": worker.pid, "argv": argv, "api_key": key}, f)
os.replace(record + ".tmp", record)
print("loading weights", flush=True)
if exit_code:
    print("cuda not found", flush=True)
    sys.exit(exit_code)
time.sleep(delay)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if key and self.headers.get("Authorization") != "Bearer " + key:
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"data": [{"id": name}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


@contextmanager
def _fake_vllm_cli(tmp_path, *cli_args, delay=0.0, exit_code=0, env=None):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    record = tmp_path / "record.json"
    command = shlex.join([sys.executable, str(script), str(record), str(delay), str(exit_code)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrl_oni.serve", "--backend", "vllm", "--model", "org/m",
         "--port", "0", "--startup-timeout", "60", "--vllm-command", command, *cli_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _cli_env())
    info = {}
    try:
        yield proc, record, info
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if record.exists():  # never leave the fake's processes behind, whatever happened
            pids = json.loads(record.read_text())
            for pid in (pids["pid"], pids["worker"]):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@needs_proc
def test_sigterm_while_vllm_starts_stops_its_whole_process_group(tmp_path):
    with _fake_vllm_cli(tmp_path, delay=120) as (proc, record, _):
        assert poll(record.exists, timeout=20), proc.stderr.read()
        pids = json.loads(record.read_text())
        assert _running(pids["pid"]) and _running(pids["worker"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
        assert proc.stdout.read() == ""  # never got to print a URL
        assert poll(lambda: not _running(pids["pid"]) and not _running(pids["worker"]))


@needs_proc
def test_ctrl_c_while_vllm_starts_stops_it(tmp_path):
    with _fake_vllm_cli(tmp_path, delay=120) as (proc, record, _):
        assert poll(record.exists, timeout=20), proc.stderr.read()
        pids = json.loads(record.read_text())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
        assert poll(lambda: not _running(pids["pid"]) and not _running(pids["worker"]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_vllm_dies_with_a_killed_oni_serve(tmp_path):
    with _fake_vllm_cli(tmp_path, delay=120) as (proc, record, _):
        assert poll(record.exists, timeout=20), proc.stderr.read()
        pids = json.loads(record.read_text())
        proc.kill()  # SIGKILL: no handler runs in oni-serve
        proc.wait()
        assert poll(lambda: not _running(pids["pid"]))  # the kernel's SIGTERM


@needs_proc
def test_vllm_gets_the_api_key_by_environment_and_is_probed_with_it(tmp_path):
    with _fake_vllm_cli(tmp_path, "--served-model-name", "llama",
                        env=_cli_env(ONI_SERVE_API_KEY=KEY)) as (proc, record, _):
        url = proc.stdout.readline().strip()  # printed once the keyed probe succeeded
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        seen = json.loads(record.read_text())
        assert seen["api_key"] == KEY and KEY not in seen["argv"]  # not visible in ps
        assert seen["argv"][:2] == ["--model", "org/m"] and "llama" in seen["argv"]
        assert url == f"http://127.0.0.1:{seen['argv'][seen['argv'].index('--port') + 1]}/v1"  # vLLM itself
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert poll(lambda: not _running(seen["pid"]) and not _running(seen["worker"]))


@needs_proc
def test_vllm_dying_at_start_is_one_error_line_and_leaves_nothing(tmp_path):
    with _fake_vllm_cli(tmp_path, exit_code=3) as (proc, record, _):
        proc.wait(timeout=30)
        line = _one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, "",
                                                           proc.stderr.read()))
        assert "code 3" in line and "cuda not found" in line and "full log" in line
        pids = json.loads(record.read_text())
        assert poll(lambda: not _running(pids["worker"]))  # its group was stopped too


# ---------------------------------------------------------------------------------------------
# vLLM off loopback: on 127.0.0.1 behind oni-serve's guard (serve/proxy.py)
# ---------------------------------------------------------------------------------------------
INNER = "vllm-own-key"


@contextmanager
def _front(fake, **kw):
    from torchrl_oni.serve.proxy import GuardedProxy

    kw.setdefault("api_key", KEY)
    host = kw.pop("host", "0.0.0.0")
    insecure = kw.pop("insecure_no_auth", False)
    proxy = GuardedProxy(fake.url, model="m", upstream_key=INNER, **kw)
    handle = ServerHandle(proxy, host, 0, insecure_no_auth=insecure).start()
    try:
        yield handle
    finally:
        handle.stop()


def test_vllm_front_forwards_only_the_openai_routes_and_checks_the_key_on_every_one():
    from torchrl_oni.testing import FakeLLMServer

    with FakeLLMServer(models=("m",), api_key=INNER, vllm_routes=True) as vllm, _front(vllm) as front:
        root = f"http://127.0.0.1:{front.port}"
        # what the front closes: vLLM itself answers /invocations without any key
        status, body = _with(f"http://127.0.0.1:{vllm.port}/invocations", "POST", JSON,
                             json.dumps({"model": "m", "prompt": PROMPT}))
        assert status == 200 and body["choices"][0]["text"]
        assert vllm.open_route_calls == 1
        for path, method in (("/invocations", "POST"), ("/tokenize", "POST"), ("/pooling", "POST"),
                             ("/v1/embeddings", "POST"), ("/metrics", "GET"), ("/v1/models/../../tokenize", "POST")):
            status, body = _with(root + path, method, JSON, BODY)
            _assert_openai_error(status, body, 401, code="invalid_api_key")
            status, body = _with(root + path, method, {"Authorization": f"Bearer {KEY}", **JSON}, BODY)
            assert status in (404, 405), (path, status, body)
        assert vllm.open_route_calls == 1  # none of them went through
        for path, method, data in (("/v1/models", "GET", None), ("/v1/completions", "POST", BODY)):
            _assert_openai_error(*_with(root + path, method, JSON, data), 401, code="invalid_api_key")
        auth = {"Authorization": f"Bearer {KEY}", **JSON}
        status, body = _with(root + "/v1/models", "GET", auth)
        assert status == 200 and body["data"][0]["id"] == "m"
        status, body = _with(root + "/v1/completions", "POST", auth,
                             json.dumps({"model": "m", "prompt": [PROMPT], "max_tokens": 4}))
        assert status == 200 and len(body["choices"]) == 1
        status, body = _with(root + "/v1/chat/completions", "POST", auth, json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": PROMPT}]}))
        assert status == 200 and body["choices"][0]["message"]["content"]
        # vLLM saw its own key on every forwarded request, never the client's
        assert set(vllm.authorization) == {f"Bearer {INNER}"}
        assert _with(root + "/health")[0] == 200  # vLLM's health, open as the embedded server's


def test_vllm_front_applies_the_guards_checks():
    from torchrl_oni.testing import FakeLLMServer

    with FakeLLMServer(models=("m",), api_key=INNER, vllm_routes=True) as vllm:
        with _front(vllm, max_body_bytes=4096) as front:
            url = f"http://127.0.0.1:{front.port}/v1/completions"
            auth = {"Authorization": f"Bearer {KEY}"}
            status, body = _with(url, "POST", {"Content-Type": "text/plain", **auth}, BODY)
            _assert_openai_error(status, body, 415)
            status, body = _with(url, "POST", {**JSON, **auth}, json.dumps({"model": "m", "prompt": "x" * 10_000}))
            _assert_openai_error(status, body, 413, code="request_too_large")
            status, body = _with(url, "POST", {"Origin": "http://attacker.example", **JSON, **auth}, BODY)
            _assert_openai_error(status, body, 403, code="cross_origin")
        assert vllm.requests == 0  # nothing reached vLLM
        with _front(vllm, api_key=None, insecure_no_auth=True, allowed_hosts=["gpu-node"]) as front:
            url = f"http://127.0.0.1:{front.port}/v1/models"
            _assert_openai_error(*_with(url, headers={"Host": "attacker.example"}), 403, code="host_not_allowed")
            assert _with(url, headers={"Host": "gpu-node:8000"})[0] == 200


def test_vllm_front_drops_the_upstream_request_of_a_client_that_leaves_and_says_502_when_vllm_is_gone():
    from torchrl_oni.testing import FakeLLMServer

    with FakeLLMServer(models=("m",), api_key=INNER, mode="hang", hang_s=30) as vllm, _front(vllm) as front:
        url = f"http://127.0.0.1:{front.port}/v1/completions"

        async def leave_early():
            async with aiohttp.ClientSession() as session:
                with pytest.raises(asyncio.TimeoutError):
                    await session.post(url, data=json.dumps({"model": "m", "prompt": PROMPT}),
                                       headers={"Authorization": f"Bearer {KEY}", **JSON},
                                       timeout=aiohttp.ClientTimeout(total=0.5))

        asyncio.run(leave_early())
        assert poll(lambda: vllm.disconnects == 1, timeout=10)  # vLLM saw its client go
        vllm.stop()
        status, body = _with(url, "POST", {"Authorization": f"Bearer {KEY}", **JSON}, BODY)
        _assert_openai_error(status, body, 502, code="upstream_unavailable")


def test_vllm_front_streams_a_streamed_answer():
    from aiohttp import web

    from torchrl_oni.net import AppThread
    from torchrl_oni.serve.proxy import GuardedProxy

    async def chat(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("yes", " it", " is"):
            await resp.write(f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n".encode())
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def make_app():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        return app

    with AppThread(make_app, port=0) as upstream:
        proxy = GuardedProxy(upstream.url + "/v1", model="m", api_key=KEY)
        with ServerHandle(proxy, port=0).start() as front:
            async def read():
                async with aiohttp.ClientSession() as session:
                    async with session.post(front.url + "/chat/completions", headers={
                            "Authorization": f"Bearer {KEY}", **JSON}, data=json.dumps(
                            {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})) as resp:
                        assert resp.headers["Content-Type"] == "text/event-stream"
                        return [line async for line in resp.content if line.strip()]

            lines = asyncio.run(read())
    assert len(lines) == 4 and lines[-1].strip() == b"data: [DONE]"


@needs_proc
def test_vllm_off_loopback_listens_on_loopback_behind_the_front(tmp_path):
    with _fake_vllm_cli(tmp_path, "--host", "0.0.0.0", "--served-model-name", "llama",
                        env=_cli_env(ONI_SERVE_API_KEY=KEY)) as (proc, record, _):
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), proc.stderr.read() if not url else url
        seen = json.loads(record.read_text())
        argv = seen["argv"]
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv.count("--host") == 1  # vLLM: loopback only
        inner_port = int(argv[argv.index("--port") + 1])
        assert f":{inner_port}/" not in url  # clients reach the front, not vLLM
        assert seen["api_key"] and seen["api_key"] != KEY  # vLLM has a key of its own
        assert _call("GET", url + "/models")[0] == 401
        status, _, body = _call("GET", url + "/models", key=KEY)
        assert status == 200 and body["data"][0]["id"] == "llama"
        assert _call("POST", url.replace("/v1", "/invocations"), {"prompt": "x"}, key=KEY)[0] == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "127.0.0.1:" in err and "forwards" in err and KEY not in err
        assert poll(lambda: not _running(seen["pid"]) and not _running(seen["worker"]))


@pytest.mark.parametrize("args,words", [
    (["--", "--host", "0.0.0.0"], "give --host to oni-serve"),
    (["--", "--port=9000"], "give --port to oni-serve"),
    (["--read-timeout", "5"], "only off loopback"),
])
def test_vllm_flags_that_would_undo_the_front_are_refused(args, words):
    line = _one_error_line(_cli("--backend", "vllm", "--model", "m", "--vllm-command", "/nonexistent/x", *args))
    assert words in line
