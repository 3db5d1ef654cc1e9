"""Tests of LLMClient on its own (no annotator around it), over real HTTP against the
fault-injecting fake server (torchrl_oni.testing.FakeLLMServer): prompts of any kind in, texts or
failures out, in order."""
import asyncio

import pytest

from helpers import RULES
from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators.client import CIRCUIT_OPEN, Completion, LLMClient
from torchrl_oni.annotators.parsing import parse_label
from torchrl_oni.testing import FakeLLMServer

pytestmark = pytest.mark.timeout(60)

CAPTIONS = ["You kill the newt!", "It's a wall.", "You see here 14 gold pieces.",
            "There is a staircase down here.", "Never mind."]
# A prompt the fake model has no rule for: it answers it with this text.
FREE_PROMPT = [{"role": "user", "content": "What is the capital of Gehennom?"}]
FREE_ANSWER = "I cannot tell."


def ask(client, conversations, **kwargs):
    """``client.complete(...)`` in a fresh event loop, closing the client afterwards."""
    async def scenario():
        try:
            return await client.complete(conversations, **kwargs)
        finally:
            await client.aclose()
    return asyncio.run(scenario())


def quick_client(url, **kwargs):
    # Short retry delays and a fixed time limit: these tests count requests, not seconds.
    opts = dict(backoff_s=0.001, max_backoff_s=0.01, timeout_s=2.0, adaptive=False)
    opts.update(kwargs)
    return LLMClient(url, "fake-model", **opts)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_complete_answers_any_prompt(api):
    with FakeLLMServer() as server:
        client = quick_client(server.url, api=api)
        answers = ask(client, [FREE_PROMPT, FREE_PROMPT])
        assert all(isinstance(a, Completion) and a.ok for a in answers)
        assert [a.text for a in answers] == [FREE_ANSWER, FREE_ANSWER]
        assert all(a.endpoint is not None for a in answers)  # for record_parse
        assert server.last_payload["model"] == "fake-model"
        metrics = client.metrics()
        assert metrics["requests_sent"] == (2 if api == "chat" else 1)
        assert metrics["server_errors"] == 0 and metrics["servers_up"] == 1


def test_completions_batch_answers_come_back_in_prompt_order():
    # Choices come back reversed; the client must match them to prompts by their index.
    with FakeLLMServer(shuffle_choices=True) as server:
        client = quick_client(server.url, api="completions", batch_size=2)
        conversations = [P.classification_messages(c) for c in CAPTIONS]
        answers = ask(client, conversations, stop=["</label>"], max_tokens=64)
        assert server.batch_sizes == [2, 2, 1]
        assert [parse_label(a.text) for a in answers] == [RULES.label(c) for c in CAPTIONS]
        assert server.last_payload["stop"] == ["</label>"] and server.last_payload["max_tokens"] == 64


def test_a_server_error_is_retried_then_answered():
    with FakeLLMServer() as server:
        server.fail_next(1, "http500")
        client = quick_client(server.url, api="chat", max_retries=1)
        (answer,) = ask(client, [FREE_PROMPT])
        assert answer.ok and answer.text == FREE_ANSWER
        metrics = client.metrics()
        assert (metrics["requests_sent"], metrics["server_errors"]) == (2, 1)
        assert client.stats.errors_by_kind["http 500"] == 1
        assert client.recent()["ok"] == 1


def test_failures_come_back_as_errors_and_an_open_breaker_sends_nothing():
    with FakeLLMServer(mode="http500") as server:
        client = quick_client(server.url, api="chat", max_retries=0, circuit_failures=1,
                              circuit_cooldown_s=60.0, probe_interval_s=60.0)

        async def scenario():
            try:
                failed = await client.complete([FREE_PROMPT])  # opens the breaker
                sent = server.requests
                refused = await client.complete([FREE_PROMPT, FREE_PROMPT])
                return failed, sent, refused
            finally:
                await client.aclose()

        failed, sent, refused = asyncio.run(scenario())
        assert [a.error for a in failed] == ["http 500"]
        assert [a.error for a in refused] == [CIRCUIT_OPEN, CIRCUIT_OPEN]
        assert server.requests == sent == 1  # refused without sending
        assert client.metrics()["requests_unsent"] >= 1
        assert "taken out" in client.describe() and not client.available()


def test_check_finds_the_only_model_and_record_parse_counts_verdicts():
    with FakeLLMServer(models=("only-model",)) as server:
        client = LLMClient(server.url, None, api="chat")
        assert [a.error for a in asyncio.run(client.complete([FREE_PROMPT]))] == [
            "no model: await check() first"]

        async def scenario():
            try:
                assert await client.check() == ["only-model"]
                return await client.complete([FREE_PROMPT])
            finally:
                await client.aclose()

        (answer,) = asyncio.run(scenario())
        assert client.model == "only-model" and answer.ok
        client.record_parse(False, answer)
        client.record_parse(True, answer)
        assert (client.stats.unparsable, client.stats.labelled) == (1, 1)
        assert client.metrics()["unparsable"] == 1 and client.recent()["unparsable"] == 1


def test_aclose_twice_is_safe():
    client = LLMClient("localhost:1", "m")

    async def close_twice():
        await client.aclose()
        await client.aclose()

    asyncio.run(close_twice())
