"""Tests of torchrl_oni.serve: the OpenAI-compatible server, the vLLM launcher and the CLI."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from helpers import run_cli
from torchrl_oni.serve.embedded import start_embedded_server
from torchrl_oni.serve.engines import ScriptedEngine
from torchrl_oni.serve.models import TEST_MODEL, is_installed, resolve_model
from torchrl_oni.serve.vllm import VLLMLaunchError, VLLMServer, vllm_command

POSITIVE = ["You kill the newt!", "You see here 7 gold pieces.", "There is a staircase down here."]
NEGATIVE = ["It's a wall.", "Never mind.", "That door is closed."]


def _short_prompt(message: str) -> str:
    # Our own minimal few-shot layout; the server must not depend on any particular wording.
    return ("Message: You kill the jackal!\nProgress: yes\nMessage: It's solid stone.\n"
            f"Progress: no\nMessage: <message>{message}</message>\nProgress:")


def _post(url: str, body) -> tuple:
    async def go():
        async with aiohttp.ClientSession() as session:
            data = body if isinstance(body, (bytes, str)) else json.dumps(body)
            async with session.post(url, data=data,
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    return asyncio.run(go())


def _get(url: str) -> tuple:
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as resp:
                return resp.status, await resp.json()

    return asyncio.run(go())


class TestScriptedServer:
    def test_models_listing(self, scripted):
        status, body = _get(scripted.url + "/models")
        assert status == 200
        assert [m["id"] for m in body["data"]] == [scripted.model]

    def test_openai_client_completions_list(self, scripted):
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=scripted.url, api_key="EMPTY", max_retries=0)
        prompts = [_short_prompt(m) for m in POSITIVE + NEGATIVE]
        out = client.completions.create(model=scripted.model, prompt=prompts, max_tokens=1,
                                        temperature=0.1)
        assert sorted(c.index for c in out.choices) == list(range(len(prompts)))
        by_index = {c.index: c.text for c in out.choices}
        assert [by_index[i] for i in range(len(prompts))] == ["yes"] * 3 + ["no"] * 3

    def test_openai_client_chat_logprobs(self, scripted):
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=scripted.url, api_key="EMPTY", max_retries=0)
        out = client.chat.completions.create(
            model=scripted.model, max_tokens=1, logprobs=True, top_logprobs=2,
            messages=[{"role": "user", "content": _short_prompt("You kill the newt!")}])
        choice = out.choices[0]
        assert choice.message.content == "yes"
        top = choice.logprobs.content[0].top_logprobs
        assert [t.token for t in top] == ["yes", "no"]
        assert math.isclose(sum(math.exp(t.logprob) for t in top), 1.0, rel_tol=1e-6)

    def test_completions_logprobs_format(self, scripted):
        status, body = _post(scripted.url + "/completions", {
            "model": scripted.model, "prompt": [_short_prompt("It's a wall.")],
            "max_tokens": 1, "logprobs": 2})
        assert status == 200
        lp = body["choices"][0]["logprobs"]
        assert lp["tokens"] == ["no"]
        assert set(lp["top_logprobs"][0]) == {"yes", "no"}
        assert lp["top_logprobs"][0]["no"] > lp["top_logprobs"][0]["yes"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"])

    def test_tagged_and_ranking_answer_formats(self, scripted):
        tagged = "Judge.\n<message>You kill the newt!</message>\n<label>FOO or BAR</label>"
        ranking = "<message_1>It's a wall.</message_1>\n<message_2>You kill the newt!</message_2>\n<best>1, 2 or tie</best>"
        status, body = _post(scripted.url + "/completions", {
            "model": scripted.model, "prompt": [tagged, ranking], "max_tokens": 64})
        assert status == 200
        texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        assert "<label>FOO</label>" in texts[0]
        assert "<best>2</best>" in texts[1]

    def test_concurrent_requests_each_get_their_answers(self, scripted):
        messages = POSITIVE + NEGATIVE

        async def go():
            async with aiohttp.ClientSession() as session:
                async def one(msg):
                    body = {"model": scripted.model, "prompt": [_short_prompt(msg)] * 2,
                            "max_tokens": 1}
                    async with session.post(scripted.url + "/completions", json=body) as resp:
                        return [c["text"] for c in (await resp.json())["choices"]]
                return await asyncio.gather(*(one(m) for m in messages * 3))

        answers = asyncio.run(go())
        expected = [["yes"] * 2] * 3 + [["no"] * 2] * 3
        assert answers == expected * 3

    @pytest.mark.parametrize("body,status,param", [
        (b"{not json", 400, None),
        ([1, 2], 400, None),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ({"prompt": 3}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ({"prompt": "x", "stream": True}, 400, "stream"),
    ])
    def test_bad_completion_requests_are_json_4xx(self, scripted, body, status, param):
        got, err = _post(scripted.url + "/completions", body)
        assert got == status
        assert err["error"]["message"] and err["error"]["param"] == param

    def test_bad_chat_requests_are_json_4xx(self, scripted):
        got, err = _post(scripted.url + "/chat/completions", {"messages": "hi"})
        assert got == 400 and err["error"]["param"] == "messages"
        got, err = _post(scripted.url + "/chat/completions",
                         {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
        assert got == 404 and err["error"]["code"] == "model_not_found"

    def test_stop_releases_port(self):
        server = start_embedded_server(backend="scripted", port=0)
        url = server.url
        assert _get(url + "/models")[0] == 200
        server.stop()
        server.stop()  # idempotent
        with pytest.raises(aiohttp.ClientConnectionError):
            _get(url + "/models")


def test_scripted_engine_reads_the_last_tagged_message():
    engine = ScriptedEngine()
    prompt = "<message>You kill the jackal!</message> -> yes\n<message>It's a wall.</message>"
    assert [c.text for c in engine.complete([prompt], max_tokens=1)] == ["no"]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _cli(*args, timeout=60):
    return run_cli("torchrl_oni.serve", *args, timeout=timeout)


@pytest.mark.parametrize("args", [
    ["--bogus"],
    ["--backend", "llamafile"],
    ["--port", "70000"],
    ["--threads", "0"],
    ["--model", "no-such-model"],
    ["--backend", "scripted", "--", "--dtype", "float16"],
    ["--backend", "vllm"],
])
def test_cli_usage_errors_exit_2_with_one_line(args):
    proc = _cli(*args)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith("oni-serve: error:")
    assert "Traceback" not in proc.stderr


def test_cli_serves_prints_url_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "torchrl_oni.serve", "--backend", "scripted",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        status, body = _get(url + "/models")
        assert status == 200 and body["data"][0]["id"] == "scripted"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# vLLM launcher (logic tested against a fake server; a real vLLM only where installed)
# ---------------------------------------------------------------------------------------------
FAKE_SERVER = [sys.executable, "-m", "torchrl_oni.serve", "--backend", "scripted"]


def test_vllm_command_layout():
    cmd = vllm_command("org/model", host="0.0.0.0", port=9001, served_model_name="m",
                       extra_args=["--dtype", "float16"], python="py")
    assert cmd == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/model",
                   "--host", "0.0.0.0", "--port", "9001", "--served-model-name", "m",
                   "--dtype", "float16"]


def test_vllm_launcher_waits_for_model_and_stops(tmp_path):
    server = VLLMServer("any-path", port=0, served_model_name="fake-llm", launcher=FAKE_SERVER,
                        startup_timeout=60, log_path=str(tmp_path / "log.txt"))
    with server:
        status, body = _get(server.url + "/models")
        assert status == 200 and [m["id"] for m in body["data"]] == ["fake-llm"]
        proc = server.process
    assert proc.poll() is not None  # stopped on exit


def test_vllm_launcher_reports_a_dying_process(tmp_path):
    launcher = [sys.executable, "-c", "import sys; print('cuda not found'); sys.exit(3)"]
    server = VLLMServer("m", port=0, launcher=launcher, startup_timeout=60,
                        log_path=str(tmp_path / "log.txt"))
    with pytest.raises(VLLMLaunchError, match=r"(?s)code 3.*cuda not found"):
        server.start()


def test_vllm_launcher_times_out_and_kills(tmp_path):
    launcher = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    server = VLLMServer("m", port=0, launcher=launcher, startup_timeout=1.5,
                        log_path=str(tmp_path / "log.txt"))
    with pytest.raises(VLLMLaunchError, match=r"(?s)not ready.*loading"):
        server.start()
    assert server.process.poll() is not None


@pytest.mark.slow
def test_real_vllm_server_if_available():
    pytest.importorskip("vllm")
    model = os.environ.get("ONI_VLLM_TEST_MODEL")
    if not model:
        pytest.skip("set ONI_VLLM_TEST_MODEL to a local model path to run a real vLLM server")
    with VLLMServer(model, port=0, served_model_name="t", startup_timeout=900) as server:
        status, body = _post(server.url + "/completions",
                             {"model": "t", "prompt": ["a", "b"], "max_tokens": 1, "logprobs": 2})
        assert status == 200 and len(body["choices"]) == 2


# ---------------------------------------------------------------------------------------------
# The packaged model (skipped when its package or transformers is missing)
# ---------------------------------------------------------------------------------------------
def _need_model():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    if not is_installed(TEST_MODEL):
        pytest.skip(f"model package missing: {resolve_model(TEST_MODEL).pip_install}")


@pytest.fixture(scope="module")
def model_server():
    _need_model()
    import torch

    torch.set_num_threads(1)
    # fp32 so batched/prefix-cached results can be compared tightly with a plain forward.
    with start_embedded_server(TEST_MODEL, port=0, threads=1, dtype="float32") as server:
        yield server


def test_prefix_cached_batch_matches_plain_forward(model_server):
    import torch

    engine = model_server.server.engine
    prompts = [_short_prompt(m) for m in ("You kill the newt!", "It's a wall.", "Never mind.")]
    batched = engine.complete(prompts, max_tokens=1, top_logprobs=3)
    single = [engine.complete([p], max_tokens=1, top_logprobs=3)[0] for p in prompts]
    assert engine.prefix_cache.hits > 0
    for prompt, b, s in zip(prompts, batched, single):
        ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            logp = torch.log_softmax(engine.model(ids).logits[0, -1].float(), -1)
        top = logp.topk(3)
        want = [float(v) for v in top.values]
        assert [v for _, v in b.top_logprobs[0]] == pytest.approx(want, abs=1e-3)
        assert [v for _, v in s.top_logprobs[0]] == pytest.approx(want, abs=1e-3)
        assert b.tokens == s.tokens


@pytest.mark.parametrize("name", sorted(__import__("torchrl_oni.serve.models", fromlist=["MODELS"]).MODELS))
def test_the_packaged_judges_answer_onis_short_prompt_with_the_label_first(name):
    """Why oni-train asks the packaged judges for one token (``answer_tokens``): their first token
    is the label, so a second changes no score."""
    _need_model()
    if not is_installed(name):
        pytest.skip(f"model package missing: {resolve_model(name).pip_install}")
    from torchrl_oni.annotators.probe import NOT_PROGRESS, PROGRESS
    from torchrl_oni.annotators.prompts import render_text, short_messages
    from torchrl_oni.serve.engines import make_engine
    from torchrl_oni.train.annotator_types import answer_tokens

    engine = make_engine("embedded", name, dtype="float32", threads=1)
    prompts = [render_text(short_messages(m)) for m in [*NOT_PROGRESS, *PROGRESS["default"], *POSITIVE, *NEGATIVE]]
    two = engine.complete(prompts, max_tokens=2, top_logprobs=5, stop=["\n"])
    one = engine.complete(prompts, max_tokens=1, top_logprobs=5)
    for a, b in zip(two, one):
        assert a.tokens[0].strip() in ("yes", "no") and a.tokens[0] == b.tokens[0], (a.tokens, b.tokens)
        assert a.top_logprobs[0] == [(t, pytest.approx(v, abs=1e-3)) for t, v in b.top_logprobs[0]]
    assert answer_tokens("short", name) == 1
    assert answer_tokens("tagged", name) is None and answer_tokens("short", "my-judge") is None


def test_model_server_openai_client(model_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=model_server.url, api_key="EMPTY", max_retries=0)
    prompts = [_short_prompt(m) for m in ("You kill the newt!", "It's a wall.")]
    out = client.completions.create(model=model_server.model, prompt=prompts, max_tokens=1,
                                    logprobs=5, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        top = choice.logprobs.top_logprobs[0]
        assert len(top) == 5 and all(v <= 0 for v in top.values())
        assert choice.logprobs.tokens[0] in top
    chat = client.chat.completions.create(
        model=model_server.model, max_tokens=4, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Answer yes or no: is gold useful in NetHack?"}])
    content = chat.choices[0].logprobs.content
    assert 1 <= len(content) <= 4 and chat.choices[0].message.content.strip()
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_engine_skips_and_aborts_prompts_nobody_waits_for(model_server):
    engine = model_server.server.engine
    prompts = [_short_prompt("You kill the newt!"), _short_prompt("It's a wall.")]
    full = engine.complete(prompts, max_tokens=8)
    assert len(full[1].tokens) > 2 and full[1].finish_reason == "length"
    dead = engine.complete(prompts, max_tokens=8, alive=lambda: [False, False])
    assert [(c.finish_reason, c.tokens, c.prompt_tokens) for c in dead] == [("abort", [], 0)] * 2
    checks = []

    def alive():  # asked before tokenising, then between steps: the 2nd client leaves after 2
        checks.append(1)
        return [True, len(checks) < 3]

    mixed = engine.complete(prompts, max_tokens=8, alive=alive)
    assert mixed[0].tokens == full[0].tokens and mixed[0].finish_reason == full[0].finish_reason
    assert mixed[1].finish_reason == "abort" and mixed[1].tokens == full[1].tokens[:2]


def test_prompt_too_long_for_the_context_is_400_and_spares_its_batch(model_server):
    engine = model_server.server.engine
    too_long = "a " * engine.max_context  # more tokens than the context, under the byte bound
    assert len(too_long.encode()) < engine.max_prompt_bytes
    out = engine.complete([_short_prompt("It's a wall."), too_long], max_tokens=1)
    assert out[0].error is None and out[0].tokens
    assert out[1].finish_reason == "error" and "exceeds the model's context" in out[1].error

    async def go():
        async with aiohttp.ClientSession() as session:
            async def one(prompt):
                body = {"model": model_server.model, "prompt": prompt, "max_tokens": 1}
                async with session.post(model_server.url + "/completions", json=body) as resp:
                    return resp.status, await resp.json()
            return await asyncio.gather(one(too_long), one(_short_prompt("It's a wall.")))

    (status, err), (ok_status, ok) = asyncio.run(go())
    assert status == 400 and err["error"]["param"] == "prompt"
    assert err["error"]["code"] == "context_length_exceeded" and "tokens" in err["error"]["message"]
    assert ok_status == 200 and ok["choices"][0]["text"]


def test_prompt_over_the_byte_bound_is_refused_untokenised(model_server):
    engine = model_server.server.engine
    health = model_server.url.replace("/v1", "/health")
    calls = _get(health)[1]["engine_calls"]
    huge = "word " * (engine.max_prompt_bytes // 5 + 1)
    status, body = _post(model_server.url + "/completions",
                         {"model": model_server.model, "prompt": huge, "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert _get(health)[1]["engine_calls"] == calls  # the engine (and its tokenizer) never saw it
