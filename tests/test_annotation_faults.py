"""Annotation that survives slow, dead and flaky LLM servers (issues 11 and 14).

Every test runs the real pieces together: ``LLMAnnotationTransform`` (its worker thread and
the ``CaptionStore``) and ``OpenAIAnnotator`` over HTTP against ``torchrl_oni.testing.FakeLLMServer``,
with time scaled down (timeouts, probes and backoffs of tenths of a second).
"""
import asyncio
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from helpers import RULES, TIMEOUT, poll
from torchrl_oni.annotation import AnnotationWorker, LLMAnnotationTransform
from torchrl_oni.annotators import AnnotatorUnavailable, OpenAIAnnotator
from torchrl_oni.annotators.endpoints import AUTH_ERROR, resolve_model
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.store import FAILED, CaptionStore
from torchrl_oni.testing import FakeLLMServer

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)


def captions(n, prefix="thing"):
    """``n`` distinct captions, a third of them progress by the scripted rules."""
    return [f"You see {prefix} number {i}." if i % 3 else f"You kill {prefix} monster number {i}!"
            for i in range(n)]


def batch_of(texts):
    msgs = torch.from_numpy(encode_messages(texts))
    return TensorDict(message=msgs, caption_hash=torch.from_numpy(hash_messages(msgs)),
                      batch_size=[len(texts)])


def hashes_of(texts):
    return torch.from_numpy(hash_messages(encode_messages(texts)))


def fast_client(urls, **kwargs):
    """A client on a scaled-down clock: sub-second timeouts, probes and retries."""
    opts = dict(backoff_s=0.01, max_backoff_s=0.05, max_retries=1, circuit_failures=2,
                circuit_cooldown_s=0.5, probe_interval_s=0.05, min_timeout_s=0.5,
                max_timeout_s=2.0, first_timeout_s=1.0, target_latency_s=0.2)
    opts.update(kwargs)
    return OpenAIAnnotator(urls, "fake-model", **opts)


def assert_labels_match_rules(store, texts):
    labels, found = store.lookup(hashes_of(texts))
    assert found.all(), f"{int((~found).sum())} of {len(texts)} captions unlabelled"
    assert labels.tolist() == [RULES.label(t) for t in texts]


@pytest.fixture
def server():
    with FakeLLMServer() as srv:
        yield srv


# ---------------------------------------------------------------------------------- outages
@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_outage_mid_run_every_caption_is_labelled_after_recovery(server, outage):
    """The server dies (connections refused) or stops answering for longer than the old give-up
    schedule; captions seen before, during and after the outage all get labelled, none is given
    up, and the ones that failed go back in the queue as soon as the server answers again
    (their own backoff, an hour here, would have kept them waiting)."""
    store = CaptionStore(capacity=256, max_attempts=1, server_retry_s=3600.0)
    client = fast_client(server.url, timeout_s=0.3 if outage == "silent" else None)
    texts = captions(60)
    with LLMAnnotationTransform(store, client, poll_interval_s=0.05, close_annotator=True) as annotate:
        annotate(batch_of(texts[:20]))
        assert annotate.wait_idle(TIMEOUT)
        if outage == "refused":
            server.stop()
        else:
            server.hang_s, server.mode = 30.0, "hang"
        annotate(batch_of(texts[20:40]))  # seen while the server is down
        assert poll(lambda: annotate.metrics()["servers_up"] == 0)
        time.sleep(0.5)  # several retry rounds of the old code: 3 failures meant "given up"
        during = annotate.metrics()
        assert during["labelled"] == 20 and during["given_up"] == 0
        assert "no labels" in annotate.health(window_s=0.5) or annotate.health().startswith("ok")
        if outage == "refused":
            server.start()
        else:
            server.mode = "ok"
        annotate(batch_of(texts[40:]))
        assert annotate.wait_idle(TIMEOUT)
        after = annotate.metrics()
    assert_labels_match_rules(store, texts)
    stats = store.stats()
    assert stats["given_up"] == stats["failed"] == 0 and stats["labelled"] == 60
    assert after["requeued_total"] >= 1  # the recovery requeued the captions that had failed
    kind = "connection_errors" if outage == "refused" else "timeouts"
    assert after[kind] >= 1 and after["servers_up"] == 1


def test_breaker_refusals_cost_no_attempt(server):
    """Requests the open breaker refuses are never sent and spend no attempt: even with
    ``max_attempts=1`` nothing is given up, and everything is labelled once the server heals."""
    server.mode = "http500"
    store = CaptionStore(capacity=64, max_attempts=1, server_retry_s=0.02)
    client = fast_client(server.url, max_retries=0, circuit_failures=1, circuit_cooldown_s=0.2,
                         probe_interval_s=0.2, adaptive=False, batch_size=2)
    texts = captions(12)
    store.add(batch_of(texts)["message"])
    worker = AnnotationWorker(store, client, poll_interval_s=0.02, close_annotator=True)

    async def refused_call():  # the client alone: refused at once, nothing sent
        await client.annotate(["You kill the newt!"])  # trips the breaker
        sent = server.requests
        labels = await client.annotate(texts)
        return labels, server.requests - sent

    labels, sent = asyncio.run(refused_call())
    assert {l.error for l in labels} == {"circuit open"} and sent == 0
    assert client.metrics()["requests_unsent"] >= 1
    worker.start()
    try:
        # each probe lets one request through; it fails, the breaker opens again
        assert poll(lambda: store.stats().get("errors/http 500", 0) >= 3, timeout=5)
        assert store.stats()["given_up"] == 0
        assert int(store._captions.cols["attempts"][: len(store)].max()) == 0
        server.mode = "ok"
        assert worker.wait_idle(TIMEOUT)
    finally:
        worker.stop()
    assert_labels_match_rules(store, texts)
    # while the breaker is open the worker claims nothing: no caption is held or refused
    assert "errors/circuit open" not in store.stats()


def test_reused_store_with_failed_captions_is_relabelled(server, tmp_path):
    """A store saved by a run whose captions were given up for server reasons (the old status
    'failed') is labelled in full by the next run that uses it (``--resume``, a reused
    ``--caption-store``): the worker requeues them when it starts."""
    texts = captions(30)
    old = CaptionStore(capacity=64)
    old.add(batch_of(texts)["message"])
    slots = old.slots(hashes_of(texts)).numpy()
    old.set_labels(hashes_of(texts[:5]), [RULES.label(t) for t in texts[:5]], RULES.provenance)
    old._captions.cols["status"][slots[5:25]] = FAILED  # what the old give-up schedule left
    old._captions.cols["attempts"][slots[5:25]] = 3
    old.mark_failed(hashes_of(texts[25:]), "timeout")  # in a backoff, which is not saved
    path = old.save(tmp_path / "captions.pt")

    store = CaptionStore.load(path)
    assert store.stats()["failed"] == 20
    with LLMAnnotationTransform(store, fast_client(server.url), poll_interval_s=0.05,
                                close_annotator=True) as annotate:
        annotate(batch_of(texts[:3]))  # the first batch of the new run starts the worker
        assert annotate.wait_idle(TIMEOUT)
        assert annotate.metrics()["requeued_total"] == 20
    assert_labels_match_rules(store, texts)
    assert store.stats()["failed"] == 0
    assert sorted(server.received) == sorted(texts[5:])  # labelled ones are not asked again


def test_only_unparsable_answers_are_given_up_and_listed(server):
    server.mode = "no_label"
    store = CaptionStore(capacity=16, max_attempts=2, retry_backoff_s=0.0)
    texts = captions(3)
    with LLMAnnotationTransform(store, fast_client(server.url), poll_interval_s=0.02,
                                close_annotator=True) as annotate:
        annotate(batch_of(texts))
        assert poll(lambda: store.stats()["given_up"] == 3)
        assert annotate.wait_idle(TIMEOUT)
        metrics = annotate.metrics()
        health = annotate.health()
    assert sorted(store.given_up()) == sorted(texts)
    assert metrics["parse_failures"] == 6 and metrics["given_up"] == 3
    assert "cannot be parsed" in health or health.startswith("idle")


# ---------------------------------------------------------------------------------- slow servers
def _zipf_feed(texts, steps, seed=0):
    """A caption per step, the i-th most common with probability ~ 1/(i+1) (like NetHack's)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(texts) + 1)
    return [texts[i] for i in rng.choice(len(texts), size=steps, p=p / p.sum())]


def test_slow_server_is_not_a_failure(server):
    """A one-request-at-a-time server far slower than the first time limit: the client adapts
    (fewer prompts per request, longer limits) instead of failing, and the steps' coverage
    reaches 95 % while captions keep arriving. The old fixed settings (100 prompts, 4 in
    flight, a fixed limit below one request's time) got nothing through the same server."""
    server.serial, server.latency_s, server.per_prompt_s = True, 0.02, 0.025
    texts = captions(80)
    feed = _zipf_feed(texts, 4000)

    def run(client, seconds):
        store = CaptionStore(capacity=256)
        with LLMAnnotationTransform(store, client, poll_interval_s=0.05, close_annotator=True) as annotate:
            end = time.monotonic() + seconds
            i = 0
            while time.monotonic() < end and store.stats()["seen_coverage"] < 0.95:
                annotate(batch_of(feed[i % len(feed): i % len(feed) + 200]))
                i += 200
                time.sleep(0.05)
            return store.stats(), annotate.metrics()

    old_style = fast_client(server.url, adaptive=False, timeout_s=0.4, batch_size=100, max_concurrency=4)
    stats, metrics = run(old_style, seconds=1.5)
    # (only a rare caption that arrives alone gets through)
    assert stats["seen_coverage"] < 0.1 and metrics["timeouts"] >= 1

    stats, metrics = run(fast_client(server.url, first_timeout_s=0.4, min_timeout_s=0.2), seconds=15)
    assert stats["seen_coverage"] >= 0.95, (stats, metrics)
    assert stats["given_up"] == 0
    assert metrics["timeout_s"] > 0.4  # the limit grew to what the server needs


def test_most_frequent_captions_are_sent_first(server):
    store = CaptionStore(capacity=64)
    texts = captions(20)
    counts = np.arange(1, 21)  # caption i seen i + 1 times
    store.add(batch_of([t for t, c in zip(texts, counts) for _ in range(c)])["message"])
    client = fast_client(server.url, adaptive=False, batch_size=5, max_concurrency=1)
    worker = AnnotationWorker(store, client, batch_size=5, close_annotator=True).start()
    try:
        assert worker.wait_idle(TIMEOUT)
    finally:
        worker.stop()
    assert server.received == texts[::-1]  # one request at a time, most seen first


# ---------------------------------------------------------------------------------- pool
def test_pool_server_killed_and_restarted_loses_nothing():
    """Two servers; one dies mid-run and comes back. Its requests in flight are retried on the
    other, labels keep coming while it is out, it is health-checked back in, and every caption
    ends up labelled once."""
    with FakeLLMServer(latency_s=0.02) as a, FakeLLMServer(latency_s=0.02) as b:
        store = CaptionStore(capacity=512)
        client = fast_client([a.url, b.url], circuit_failures=3)
        texts = captions(300)
        with LLMAnnotationTransform(store, client, poll_interval_s=0.05, close_annotator=True) as annotate:
            annotate(batch_of(texts[:100]))
            assert annotate.wait_idle(TIMEOUT)
            assert a.completed > 0 and b.completed > 0  # both used
            b.stop()
            annotate(batch_of(texts[100:200]))
            assert annotate.wait_idle(TIMEOUT)  # the survivor did all the work
            during = annotate.metrics()
            assert during["servers_up"] == 1 and during["server/1/up"] == 0.0
            assert store.stats()["labelled"] == 200
            b_before = b.completed
            b.start()
            assert poll(lambda: annotate.metrics()["servers_up"] == 2)
            annotate(batch_of(texts[200:]))
            assert annotate.wait_idle(TIMEOUT)
            after = annotate.metrics()
    assert_labels_match_rules(store, texts)
    assert sorted(a.received + b.received) == sorted(set(a.received + b.received))  # none twice
    assert len(set(a.received + b.received)) == 300
    assert b.completed > b_before  # back in use
    assert after["server/0/requests"] > 0 and after["server/1/errors"] >= 1
    assert after["server/0/labels_per_s"] > 0


def test_pool_checks_every_server_serves_the_model():
    with FakeLLMServer(models=("fake-model",)) as a, FakeLLMServer(models=("other",)) as b:
        with pytest.raises(AnnotatorUnavailable, match="not served at") as err:
            asyncio.run(_check(fast_client([a.url, b.url])))
        assert b.url in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(AnnotatorUnavailable, match="different models"):
            resolve_model([a.url, b.url])
        assert resolve_model([a.url]) == "fake-model"
        dead = b.url
    # a pool starts with one server down: it is taken out, the other is used
    with FakeLLMServer() as a:
        client = fast_client([a.url, dead])
        assert asyncio.run(_check(client)) == ["fake-model"]
        assert client.metrics()["servers_up"] == 1


async def _check(client):
    try:
        return await client.check()
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------------- API key, exit
def test_api_key(monkeypatch):
    with FakeLLMServer(api_key="s3cret") as server:
        good = fast_client(server.url, api_key="s3cret")
        labels = asyncio.run(_annotate(good, ["You kill the newt!"]))
        assert labels[0].value == 1.0
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret")  # the default comes from the environment
        assert asyncio.run(_annotate(fast_client(server.url), ["It's a wall."]))[0].value == 0.0
        monkeypatch.delenv("OPENAI_API_KEY")
        bad = fast_client(server.url, api_key="wrong", max_retries=3)
        sent = server.requests
        labels = asyncio.run(_annotate(bad, ["x", "y"]))
        assert {l.error for l in labels} == {f"{AUTH_ERROR} (HTTP 401)"}
        assert server.requests - sent == 1  # not retried
        assert bad.metrics()["auth_errors"] == 1
        with pytest.raises(AnnotatorUnavailable, match="refused the API key") as err:
            asyncio.run(_check(fast_client(server.url)))
        assert "\n" not in str(err.value)
        with pytest.raises(AnnotatorUnavailable, match="refused the API key"):
            resolve_model(server.url, api_key="wrong")
        # the worker says so in one line
        store = CaptionStore(capacity=8)
        with LLMAnnotationTransform(store, fast_client(server.url, api_key="wrong"),
                                    poll_interval_s=0.02, close_annotator=True) as annotate:
            annotate(batch_of(["You kill the newt!"]))
            assert poll(lambda: "API key" in annotate.health())
        assert store.stats()["given_up"] == 0


async def _annotate(client, texts):
    try:
        return await client.annotate(texts)
    finally:
        await client.aclose()


def test_abandoned_requests_are_cancelled_at_close():
    """Requests still in flight when the run stops are abandoned: the connections close, the
    server sees the client go (and stops working on them), and the captions go back to unseen."""
    with FakeLLMServer(mode="hang") as server:
        server.hang_s = 30.0
        store = CaptionStore(capacity=64)
        annotate = LLMAnnotationTransform(store, fast_client(server.url, timeout_s=60.0, max_concurrency=3),
                                          poll_interval_s=0.05, close_annotator=True)
        annotate(batch_of(captions(40)))
        assert poll(lambda: server.in_flight == 3, timeout=5)
        t0 = time.monotonic()
        annotate.close(timeout=0.1)
        assert time.monotonic() - t0 < 3
        assert poll(lambda: server.disconnects == 3 and server.in_flight == 0, timeout=5)
        assert server.completed == 0
        assert store.stats()["unseen"] == 40 and store.stats()["pending"] == 0


# ---------------------------------------------------------------------------------- health
def test_health_names_the_dominant_cause(server):
    store = CaptionStore(capacity=64, server_retry_s=0.05)
    client = fast_client(server.url)
    with LLMAnnotationTransform(store, client, poll_interval_s=0.02, close_annotator=True) as annotate:
        annotate(batch_of(captions(10)))
        assert annotate.wait_idle(TIMEOUT)
        assert annotate.health().startswith(("ok:", "idle"))
        server.stop()
        annotate(batch_of(captions(10, prefix="Later")))
        assert poll(lambda: "cannot reach the LLM server" in annotate.health(window_s=1.0))
        line = annotate.health(window_s=1.0)
        assert line.startswith("no labels in the last 1 s") and "\n" not in line and len(line) < 400
        server.start()
        # (wait_idle does not wait for captions in a retry backoff: poll the store instead)
        assert poll(lambda: store.stats()["labelled"] == 20)
    assert annotate.health() == "annotation closed"
