"""Tests of the annotators: prompts, parsing, the scripted rules and the OpenAI-compatible client
against a fault-injecting fake server (torchrl_oni.testing.FakeLLMServer)."""
import asyncio
import socket
import time

import numpy as np
import pytest

from helpers import RULES
from torchrl_oni.annotators import (
    FIRST,
    SECOND,
    TIE,
    Annotator,
    AnnotatorUnavailable,
    CircuitBreaker,
    OpenAIAnnotator,
    ScriptedAnnotator,
)
from torchrl_oni.annotators import prompts as P
from torchrl_oni.annotators.endpoints import resolve_model
from torchrl_oni.annotators.parsing import (
    parse_label,
    parse_preference,
    parse_yes_no,
    score_from_top_logprobs,
)
from torchrl_oni.annotators.pacing import RequestSizer
from torchrl_oni.annotators.scripted import NOT_PROGRESS_EXAMPLES
from torchrl_oni.captions import MESSAGE_LEN, decode_message, encode_message
from torchrl_oni.testing import (
    P_POSITIVE_IF_NOT,
    P_POSITIVE_IF_PROGRESS,
    FakeLLMServer,
)

pytestmark = pytest.mark.timeout(60)

CAPTIONS = [
    "You kill the newt!",
    "It's a wall.",
    "You see here 14 gold pieces.",
    "",
    "Never mind.",
    "There is a staircase down here.",
    "You can't move diagonally out of an intact doorway.",
]
EXPECTED = [RULES.label(c) for c in CAPTIONS]


def run(coro):
    return asyncio.run(coro)


def make_client(server, **kwargs):
    # Fixed sizes and time limit: these tests count requests (adaptive sizing is tested apart).
    opts = dict(backoff_s=0.001, max_backoff_s=0.01, max_retries=1, timeout_s=2.0,
                circuit_failures=1000, adaptive=False)
    opts.update(kwargs)
    url = opts.pop("base_url", None) or server.url
    return OpenAIAnnotator(url, "fake-model", **opts)


async def annotate_once(client, captions):
    try:
        return await client.annotate(captions)
    finally:
        await client.aclose()


@pytest.fixture
def server():
    with FakeLLMServer(hang_s=1.5) as srv:
        yield srv


# ---------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "answer, expected",
    [
        ("<knowledge>NetHack...</knowledge>\n<analysis>A kill.</analysis>\n<label>FOO</label>",
         1.0),
        ("<knowledge>k</knowledge><analysis>a</analysis><label>BAR</label>", 0.0),
        ("<knowledge>k</knowledge>\n<label>FOO", 1.0),  # cut at the stop string
        ("<label> **BAR** </label>", 0.0),
        ("<label>foo</label>", 1.0),
        ("<LABEL>Bar</LABEL>", 0.0),
        ("<label>\nFOO\n</label>", 1.0),
        ("<label>FOO (extremely helpful)</label>", 1.0),
        # echoed instructions, then the answer
        ("Use the label FOO for progress and BAR otherwise.\n<label>FOO or BAR</label>\n"
         "<knowledge>k</knowledge><analysis>nothing happens</analysis><label>BAR</label>", 0.0),
        ("<message>You kill the jackal!</message> -> FOO\n<message>It's a wall.</message> -> BAR\n"
         "<label>FOO</label>", 1.0),
        ("<analysis>Not worth a FOO.</analysis><label>BAR</label>", 0.0),
        ("```\n<knowledge>k</knowledge>\n<label>FOO</label>\n```", 1.0),
        ("Label: FOO", 1.0),
        ("**Label:** `BAR`", 0.0),
        ("The label is FOO.", 1.0),
        ("so the label would be bar", 0.0),
        ("FOO", 1.0),
        ("bar.", 0.0),
        ("**FOO**", 1.0),
        ("This is a kill, which is great, hence FOO.", 1.0),
        # unparsable: both, none, echoes only
        ("<label>FOO or BAR</label>", None),
        ("FOO/BAR", None),
        ("The answer is FOO, not BAR", None),
        ("", None),
        ("   \n", None),
        ("I don't know.", None),
        ("You see a crowbar and a food ration here.", None),
        ("Use the label FOO for a message that shows clear progress, and the label BAR for...",
         None),
    ],
)
def test_parse_label(answer, expected):
    assert parse_label(answer) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [("Yes", 1.0), (" no", 0.0), ("Yes, because it is a kill.", 1.0), ("**No**.", 0.0),
     ("yes\n", 1.0), ("NO", 0.0), ("Progress: yes", 1.0), ("Answer yes or no.", None),
     ("Maybe", None), ("", None), ("It depends.", None)],
)
def test_parse_yes_no(answer, expected):
    assert parse_yes_no(answer) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("<knowledge>k</knowledge><analysis>a</analysis><best>1</best>", FIRST),
        ("<best>2</best>", SECOND),
        ("<best>tie</best>", TIE),
        ("<best>None</best>", TIE),
        ("<best>Message 1</best>", FIRST),
        ("<best>**2**", SECOND),  # cut at the stop string
        ("Reply with <best>1, 2 or tie</best>.\n<analysis>a</analysis><best>2</best>", SECOND),
        ("<analysis>Message 2 is better at first sight</analysis><best>1</best>", FIRST),
        ('("best_description": 2)', SECOND),
        ("best message: 1", FIRST),
        ("Best: tie", TIE),
        ("Message 2 is better because it is a kill.", SECOND),
        ("2", SECOND),
        ("<best>1, 2 or tie</best>", None),
        ("Message 1 is better... no wait, message 2 is better.", None),
        ("I like both of them", None),
        ("", None),
    ],
)
def test_parse_preference(answer, expected):
    assert parse_preference(answer) == expected


def test_score_from_top_logprobs():
    import math

    score = score_from_top_logprobs(
        [("<label>", {"<label>": -0.01}), ("FOO", {"FOO": math.log(0.6), "BAR": math.log(0.2)})],
        "FOO", "BAR")
    assert score == pytest.approx(0.75)
    # A tokenizer that splits the label: "FO" is an unambiguous prefix of FOO.
    split = score_from_top_logprobs([("FO", {"FO": math.log(0.3), "BAR": math.log(0.6)})],
                                    "FOO", "BAR")
    assert split == pytest.approx(1 / 3)
    # Negative label outside the top-k: it gets at most the leftover mass.
    only_pos = score_from_top_logprobs([(" yes", {" yes": math.log(0.7), " maybe": math.log(0.2)})],
                                       "yes", "no")
    assert 0.7 / 0.8 <= only_pos < 1.0
    assert score_from_top_logprobs([("hmm", {"hmm": -0.1})], "yes", "no") is None
    assert score_from_top_logprobs([], "yes", "no") is None


# ---------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("goal", P.GOALS)
def test_prompts_render_every_goal(goal):
    caption = "You kill the newt!"
    cls = P.classification_messages(caption, goal)
    short = P.short_messages(caption, goal)
    rank = P.ranking_messages(caption, "It's a wall.", goal)
    for msgs in (cls, short, rank):
        assert [m["role"] for m in msgs] == ["system", "user"]
        for style in ("plain", "llama-3"):
            text = P.render_text(msgs, style)
            assert caption in text
    assert P.prompt_family(P.render_text(cls)) == "tagged"
    assert P.prompt_family(P.render_text(short)) == "short"
    assert P.prompt_family(P.render_text(rank)) == "ranking"
    assert P.extract_captions(P.render_text(rank)) == [caption, "It's a wall."]
    user = cls[1]["content"]
    assert f"<label>{P.POSITIVE_TOKEN} or {P.NEGATIVE_TOKEN}</label>" in user
    shots = 0 if goal == "zero-knowledge" else 4
    assert ("Examples:" in user) == bool(shots)
    assert user.count("<message>") == shots + 1  # the examples and the judged message
    assert short[1]["content"].count("Message:") == shots + 1


def test_goal_sentences_differ_and_versions():
    users = {g: P.classification_user_prompt("x", g) for g in P.GOALS}
    assert len(set(users.values())) == len(P.GOALS)
    assert "Never treat collecting gold" in users["combat"]
    assert P.prompt_version("tagged", "combat") == f"{P.CLS_PROMPT_VERSION}:combat"
    assert P.prompt_version("ranking", "defaultgoal") == f"{P.RANK_PROMPT_VERSION}:default"
    with pytest.raises(ValueError, match="unknown goal"):
        P.classification_messages("x", goal="speedrun")
    with pytest.raises(ValueError, match="unknown prompt style"):
        P.render_text([], "mistral")


@pytest.mark.parametrize("goal", [g for g in P.GOALS if g != "zero-knowledge"])
def test_few_shot_examples_agree_with_scripted_rules(goal):
    rules = ScriptedAnnotator(goal=goal)
    for message, helpful in P._EXAMPLES[goal]:
        assert rules.label(message) == float(helpful), (goal, message)


def test_llama3_layout_and_default_style():
    text = P.render_text(P.classification_messages("a"), "llama-3")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert text.count("<|eot_id|>") == 2
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert P.default_text_style("Meta-Llama-3.1-8B-Instruct") == "llama-3"
    assert P.default_text_style("qwen2.5-0.5b") == "plain"


@pytest.mark.parametrize("raw", [b"", b"\xe9l\xe8ve \xff\x80 caf\xe9", b"A" * MESSAGE_LEN,
                                 b"You kill the newt!\nNew line"])
def test_extract_captions_round_trip(raw):
    caption = decode_message(encode_message(raw))
    got = P.extract_captions(P.render_text(P.classification_messages(caption)))
    assert got == [caption.replace("\n", " ")]


# ---------------------------------------------------------------------------------- scripted
def test_scripted_rules():
    ann = ScriptedAnnotator()
    progress = ["You kill the newt!", "Welcome to experience level 2.", "$ - 37 gold pieces.",
                "There is a staircase down here.", "You find a hidden passage.",
                "You finish eating the food ration.", "You feel much better.", "You feel strong!"]
    assert [ann.label(m) for m in progress] == [1.0] * len(progress)
    assert [ann.label(m) for m in NOT_PROGRESS_EXAMPLES] == [0.0] * len(NOT_PROGRESS_EXAMPLES)
    assert ann.label("You die...") == 0.0 and ann.score("You die...") < 0
    assert ann.preference("You kill the newt!", "You die...") == FIRST
    assert ann.preference("It's a wall.", "Never mind.") == TIE
    assert ann.preference("It's a wall.", "Welcome to experience level 3.") == SECOND
    assert isinstance(ann, Annotator)
    assert ann.provenance.annotator == "scripted"


def test_scripted_goal_aware():
    gold, combat, stairs = (ScriptedAnnotator(goal=g) for g in ("gold", "combat", "stairs"))
    assert gold.label("14 gold pieces.") == 1.0 and gold.label("You kill the newt!") == 0.0
    assert combat.label("You kill the newt!") == 1.0 and combat.label("14 gold pieces.") == 0.0
    assert stairs.label("There is a staircase down here.") == 1.0
    assert stairs.label("You kill the newt!") == 0.0
    assert gold.provenance.prompt_version.endswith(":gold")
    with pytest.raises(ValueError):
        ScriptedAnnotator(goal="nope")


def test_scripted_async_api():
    ann = ScriptedAnnotator()
    labels = run(ann.annotate(CAPTIONS))
    assert [l.value for l in labels] == EXPECTED and all(l.ok for l in labels)
    prefs = run(ann.compare([("It's a wall.", "You kill the newt!"), ("x", "x")]))
    assert [p.value for p in prefs] == [SECOND, TIE]
    run(ann.aclose())


# ---------------------------------------------------------------------------------- client: ok
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_client_labels_match_rules(server, api):
    server.shuffle_choices = True  # choices must be matched by their index, not position
    client = make_client(server, api=api, batch_size=3)
    labels = run(annotate_once(client, CAPTIONS))
    assert [l.value for l in labels] == EXPECTED
    assert all(l.ok and l.provenance.annotator == "openai" for l in labels)
    assert labels[0].provenance.prompt_version == f"{P.CLS_PROMPT_VERSION}:default"
    expected_requests = 3 if api == "completions" else len(CAPTIONS)  # 7 captions, 3 per batch
    assert server.requests == expected_requests
    assert client.stats.labelled == len(CAPTIONS) and client.stats.captions == len(CAPTIONS)
    assert sorted(server.received) == sorted(CAPTIONS)


def test_client_sends_openai_payload(server):
    client = make_client(server, temperature=0.1, max_tokens=64, use_logprobs=True)
    run(annotate_once(client, ["You kill the newt!"]))
    payload = server.last_payload
    assert payload["model"] == "fake-model" and payload["temperature"] == 0.1
    assert payload["max_tokens"] == 64 and payload["logprobs"] == 5
    assert isinstance(payload["prompt"], list) and len(payload["prompt"]) == 1


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("prompt", ["tagged", "short"])
def test_client_logprob_scores(server, api, prompt):
    client = make_client(server, api=api, prompt=prompt, use_logprobs=True)
    labels = run(annotate_once(client, CAPTIONS))
    assert [l.value for l in labels] == EXPECTED
    for label, progress in zip(labels, EXPECTED):
        want = P_POSITIVE_IF_PROGRESS if progress else P_POSITIVE_IF_NOT
        assert label.score == pytest.approx(want, abs=1e-6)
    strict = make_client(server, api=api, prompt=prompt, use_logprobs=True, score_threshold=0.95)
    assert [l.value for l in run(annotate_once(strict, CAPTIONS))] == [0.0] * len(CAPTIONS)


def test_client_round_trips_odd_captions(server):
    raws = [b"", b"\xe9l\xe8ve \xff caf\xe9 \x80\x9f", b"You kill the newt! " + b"x" * 300,
            b"\"quoted\" {braces} [brackets] \\ backslash"]
    captions = [decode_message(encode_message(r)) for r in raws]
    assert len(captions[2]) == MESSAGE_LEN
    for api in ("completions", "chat"):
        server.received.clear()
        labels = run(annotate_once(make_client(server, api=api), captions))
        assert sorted(server.received) == sorted(captions)
        assert [l.value for l in labels] == [RULES.label(c) for c in captions]
        assert labels[2].value == 1.0  # the long one starts with a kill


# ---------------------------------------------------------------------------------- client: faults
FAULTS = {
    "http500": "http 500",
    "http429": "http 429",
    "hang": "timeout",
    "malformed_json": "malformed json",
    "wrong_count": "wrong count",
    "bad_index": "wrong count",
    "no_label": "unparsable",
}


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_client_fault_then_recovery(server, mode, api):
    if api == "chat" and mode == "bad_index":
        pytest.skip("one choice per chat request: an index cannot be misassigned")
    captions = CAPTIONS[:4]
    server.mode = mode
    # Only the hang needs a short time limit; elsewhere a 0.3 s limit on a loaded machine turns
    # some of the counted faults into timeouts.
    client = make_client(server, api=api, timeout_s=0.3 if mode == "hang" else 2.0, batch_size=2)

    async def scenario():
        try:
            failed = await client.annotate(captions)
            server.mode = "ok"
            healed = await client.annotate(captions)
            return failed, healed
        finally:
            await client.aclose()

    failed, healed = run(scenario())
    kind = FAULTS[mode]
    assert [l.value for l in failed] == [None] * len(captions)
    assert [l.error for l in failed] == [kind] * len(captions)
    stats = client.stats
    if mode == "no_label":
        assert stats.unparsable == len(captions)
        assert [l.raw for l in failed] == ["This message is about the dungeon."] * len(captions)
    else:
        requests = 2 if api == "completions" else len(captions)
        attempts = requests * (client.max_retries + 1)
        assert stats.errors_by_kind[kind] == attempts
        counter = stats.timeouts if mode == "hang" else stats.server_errors
        assert counter == attempts
    assert [l.value for l in healed] == EXPECTED[:4] and all(l.ok for l in healed)


def test_client_bounds_concurrency(server):
    server.mode, server.hang_s = "hang", 0.1  # slow answers, well within the client's timeout
    client = make_client(server, api="chat", max_concurrency=2)
    labels = run(annotate_once(client, CAPTIONS))
    assert [l.value for l in labels] == EXPECTED
    assert server.max_in_flight == 2


def test_client_survives_event_loop_change(server):
    client = make_client(server)
    assert [l.value for l in run(client.annotate(CAPTIONS[:2]))] == EXPECTED[:2]
    # a second asyncio.run: the old loop is closed, the client opens a new session
    assert [l.value for l in run(client.annotate(CAPTIONS[2:]))] == EXPECTED[2:]
    run(client.aclose())
    assert run(annotate_once(client, [])) == []


def test_client_retries_recover_within_one_call(server):
    server.fail_next(2, "http500")
    client = make_client(server, max_retries=3)
    labels = run(annotate_once(client, CAPTIONS))
    assert [l.value for l in labels] == EXPECTED
    assert client.stats.server_errors == 2 and client.stats.requests == 3


def test_client_server_dies_mid_run(server):
    client = make_client(server, circuit_failures=1000)

    async def scenario():
        try:
            first = await client.annotate(CAPTIONS[:2])
            await asyncio.to_thread(server.stop)
            dead = await client.annotate(CAPTIONS)
            await asyncio.to_thread(server.start)
            back = await client.annotate(CAPTIONS)
            return first, dead, back
        finally:
            await client.aclose()

    first, dead, back = run(scenario())
    assert all(l.ok for l in first)
    assert {l.error for l in dead} == {"connection error"}
    assert client.stats.errors_by_kind["connection error"] == 2  # one request, one retry
    assert [l.value for l in back] == EXPECTED


def test_client_unknown_model_is_not_retried(server):
    client = OpenAIAnnotator(server.url, "no-such-model", max_retries=3, backoff_s=0.001)
    labels = run(annotate_once(client, CAPTIONS[:3]))
    assert {l.error for l in labels} == {"http 404"}
    assert server.requests == 1


def test_circuit_breaker_opens_and_closes(server):
    server.mode = "http500"
    client = make_client(server, max_retries=0, circuit_failures=2, circuit_cooldown_s=0.3)

    async def scenario():
        try:
            a = await client.annotate(["x"])
            b = await client.annotate(["y"])
            sent = server.requests
            t0 = time.perf_counter()
            c = await client.annotate(["z", "w"])
            fast = time.perf_counter() - t0
            unsent = server.requests == sent
            await asyncio.sleep(0.35)
            server.mode = "ok"
            d = await client.annotate(CAPTIONS)
            return a, b, c, d, fast, unsent
        finally:
            await client.aclose()

    a, b, c, d, fast, unsent = run(scenario())
    assert a[0].error == b[0].error == "http 500"
    assert [l.error for l in c] == ["circuit open", "circuit open"]
    assert unsent and fast < 0.1
    assert [l.value for l in d] == EXPECTED
    assert not client.breaker.is_open


def test_circuit_breaker_half_open_reopens():
    now = [0.0]
    cb = CircuitBreaker(failures=3, cooldown_s=10.0, clock=lambda: now[0])
    for _ in range(3):
        assert cb.allow()
        cb.record_failure()
    assert not cb.allow()
    now[0] = 10.0
    assert cb.allow()
    cb.record_failure()  # the probe fails: open again at once
    assert not cb.allow()
    now[0] = 20.0
    cb.record_success()
    assert cb.allow() and cb.consecutive == 0


# ---------------------------------------------------------------------------------- client: ranking
PAIRS = [("It's a wall.", "You kill the newt!"), ("You kill the newt!", "Never mind."),
         ("It's a wall.", "Never mind.")]
EXPECTED_PREFS = [RULES.preference(a, b) for a, b in PAIRS]


@pytest.mark.parametrize("mode", ["direct", "both_orders", "scores"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_compare_modes(server, mode, api):
    client = make_client(server, api=api, ranking=mode, use_logprobs=(mode == "scores"))

    async def scenario():
        try:
            return await client.compare(PAIRS + [("same", "same")])
        finally:
            await client.aclose()

    prefs = run(scenario())
    assert [p.value for p in prefs] == EXPECTED_PREFS + [TIE]
    assert all(p.ok for p in prefs)
    assert prefs[0].provenance.prompt_version.endswith(mode)
    assert "same" not in server.received  # identical pairs tie without a request


def test_compare_position_bias(server):
    server.ranking_bias = "1"  # a model that always picks the first message
    pair = [("It's a wall.", "You kill the newt!")]

    async def ask(mode):
        client = make_client(server, ranking=mode)
        try:
            return (await client.compare(pair))[0].value
        finally:
            await client.aclose()

    assert run(ask("direct")) == FIRST  # fooled
    assert run(ask("both_orders")) == TIE  # the bias cancels out
    assert run(ask("scores")) == SECOND  # unaffected by the ranking prompt


@pytest.mark.parametrize("mode", ["direct", "both_orders", "scores"])
def test_compare_faults_return_failures(server, mode):
    client = make_client(server, ranking=mode)
    server.mode = "http500"
    prefs = run(annotate_pairs(client, PAIRS))
    assert [p.error for p in prefs] == ["http 500"] * len(PAIRS)
    server.mode = "no_label"
    prefs = run(annotate_pairs(make_client(server, ranking=mode), PAIRS))
    assert [p.error for p in prefs] == ["unparsable"] * len(PAIRS)
    server.mode = "ok"
    prefs = run(annotate_pairs(make_client(server, ranking=mode), PAIRS))
    assert [p.value for p in prefs] == EXPECTED_PREFS


async def annotate_pairs(client, pairs):
    try:
        return await client.compare(pairs)
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------------- client: check
def test_check_lists_models(server):
    async def scenario():
        client = make_client(server)
        try:
            return await client.check()
        finally:
            await client.aclose()
            await client.aclose()  # twice is fine

    assert run(scenario()) == ["fake-model"]


def test_check_unknown_model(server):
    client = OpenAIAnnotator(server.url, "llama-9000")
    with pytest.raises(AnnotatorUnavailable, match="not served") as err:
        run(check_and_close(client))
    assert "fake-model" in str(err.value) and "\n" not in str(err.value)


def test_check_dead_server():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = OpenAIAnnotator(f"127.0.0.1:{port}", "m", timeout_s=2.0)
    with pytest.raises(AnnotatorUnavailable, match="cannot reach") as err:
        run(check_and_close(client))
    assert "\n" not in str(err.value)
    # annotate on a dead server fails softly
    labels = run(annotate_once(OpenAIAnnotator(f"127.0.0.1:{port}", "m", max_retries=0), ["x"]))
    assert labels[0].error == "connection error"


def test_check_not_openai_server(server):
    client = OpenAIAnnotator(f"http://127.0.0.1:{server.port}/api", "fake-model")
    with pytest.raises(AnnotatorUnavailable, match="HTTP 404"):
        run(check_and_close(client))


async def check_and_close(client):
    try:
        return await client.check()
    finally:
        await client.aclose()


@pytest.mark.parametrize("url", ["", "ftp://host:1/v1", "http://", "http://host:99999/v1",
                                 "://nohost"])
def test_invalid_urls(url):
    with pytest.raises(ValueError, match="invalid LLM server URL"):
        OpenAIAnnotator(url, "m")


@pytest.mark.parametrize("url, normal", [
    ("localhost:9001", "http://localhost:9001/v1"),
    ("http://gpu-node:9001", "http://gpu-node:9001/v1"),
    ("http://10.0.0.2:8000/v1/", "http://10.0.0.2:8000/v1"),
    ("https://llm.example.org/openai/v1", "https://llm.example.org/openai/v1"),
])
def test_url_normalisation(url, normal):
    assert OpenAIAnnotator(url, "m").base_url == normal


def test_invalid_options():
    for kwargs in (dict(api="grpc"), dict(prompt="long"), dict(ranking="elo"),
                   dict(goal="speedrun"), dict(batch_size=0)):
        with pytest.raises(ValueError):
            OpenAIAnnotator("localhost:1", "m", **kwargs)
    with pytest.raises(ValueError, match="model name"):
        OpenAIAnnotator("localhost:1", "")


def test_client_is_an_annotator():
    assert isinstance(OpenAIAnnotator("localhost:1", "m"), Annotator)


# ---------------------------------------------------------------------------------- adaptive sizing
def test_request_sizer_grows_shrinks_and_times_out_from_observed_latency():
    sizer = RequestSizer(max_batch=64, max_concurrency=4, initial_batch=4, target_latency_s=10.0,
                         min_timeout_s=30.0, max_timeout_s=600.0, first_timeout_s=120.0)
    assert (sizer.batch, sizer.concurrency, sizer.timeout(4)) == (4, 4, 120.0)
    for expected in (8, 16, 32, 64, 64):  # fast full requests double the batch up to the max
        sizer.record_answer(sizer.batch, latency_s=1.0)
        assert sizer.batch == expected
    sizer.record_answer(3, latency_s=0.1)  # a partial request says nothing about growth
    assert sizer.batch == 64
    # the limit is 4 x p90(seconds per prompt) x n, within [30, 600]
    per_prompt = sorted([1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 64, 0.1 / 3])
    p90 = per_prompt[int(np.ceil(0.9 * len(per_prompt))) - 1]
    assert sizer.timeout(64) == max(30.0, 4 * p90 * 64)
    assert sizer.timeout(10_000) == 600.0
    sizer.record_answer(64, latency_s=25.0)  # slower than 2 x target: halve
    assert sizer.batch == 32
    assert sizer.timeout(32) == pytest.approx(4 * 25.0 / 64 * 32)  # the latest sample counts at once
    sizer.record_timeout(32, limit_s=200.0)  # no answer in 200 s: >= 6.25 s per prompt
    assert (sizer.batch, sizer.concurrency) == (16, 2)
    assert sizer.timeout(16) == 4 * 200.0 / 32 * 16  # twice the last limit per prompt
    sizer.record_answer(16, latency_s=5.0)  # within target: one more request in flight
    assert sizer.concurrency == 3


def test_request_sizer_fixed_settings():
    fixed = RequestSizer(max_batch=100, max_concurrency=4, adaptive=False, timeout_s=60.0)
    assert (fixed.batch, fixed.timeout(100)) == (100, 60.0)
    fixed.record_timeout(100, 60.0)
    fixed.record_answer(100, 500.0)
    assert (fixed.batch, fixed.concurrency, fixed.timeout(1)) == (100, 4, 60.0)
    with pytest.raises(ValueError):
        RequestSizer(timeout_s=0)
    with pytest.raises(ValueError):
        RequestSizer(min_timeout_s=10.0, max_timeout_s=5.0)


def test_adaptive_client_grows_requests_on_a_fast_server(server):
    client = OpenAIAnnotator(server.url, "fake-model", batch_size=32, initial_batch_size=2,
                             max_concurrency=1)

    async def scenario():
        try:
            for _ in range(3):
                await client.annotate(CAPTIONS * 10)
        finally:
            await client.aclose()

    run(scenario())
    assert client.metrics()["request_batch"] == 32
    assert server.batch_sizes[:5] == [2, 4, 8, 16, 32] and max(server.batch_sizes) == 32
    assert client.stats.labelled == 3 * 70


def test_slow_answers_stretch_the_time_limit_instead_of_failing(server):
    """The first limit is far too short for this server: the requests that time out teach the
    client a longer limit and smaller requests, and the labels come in within one call."""
    server.mode, server.hang_s = "hang", 0.3
    client = OpenAIAnnotator(server.url, "fake-model", batch_size=8, initial_batch_size=4,
                             first_timeout_s=0.1, min_timeout_s=0.05, max_timeout_s=5.0,
                             max_retries=4, backoff_s=0.001, max_backoff_s=0.01)
    labels = run(annotate_once(client, CAPTIONS))
    assert [l.value for l in labels] == EXPECTED
    metrics = client.metrics()
    assert metrics["timeouts"] >= 1 and metrics["timeout_s"] > 0.3


# ---------------------------------------------------------------------------------- model, key
def test_resolve_model():
    with FakeLLMServer(models=("only-one",)) as one, FakeLLMServer(models=("a", "b")) as two:
        assert resolve_model(one.url) == "only-one"
        assert resolve_model(two.url, "b") == "b"
        with pytest.raises(AnnotatorUnavailable, match="several models \\(a, b\\)") as err:
            resolve_model(two.url)
        assert "--llm-model" in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(AnnotatorUnavailable, match="not served .* served: a, b"):
            resolve_model(two.url, "c")
        dead = one.url
    with pytest.raises(AnnotatorUnavailable, match="cannot reach"):
        resolve_model(dead, timeout_s=2.0)


def test_api_key_header(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert OpenAIAnnotator("localhost:1", "m")._headers == {}
    assert OpenAIAnnotator("localhost:1", "m", api_key="k")._headers == {"Authorization": "Bearer k"}
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    assert OpenAIAnnotator("localhost:1", "m")._headers == {"Authorization": "Bearer from-env"}
    assert OpenAIAnnotator("localhost:1", "m", api_key="")._headers == {}  # explicitly none


# ---------------------------------------------------------------------------------- pool
def test_pool_spreads_requests_by_least_outstanding():
    with FakeLLMServer(latency_s=0.05) as a, FakeLLMServer(latency_s=0.05) as b:
        client = make_client(None, base_url=[a.url, b.url], batch_size=2, max_concurrency=2)
        labels = run(annotate_once(client, CAPTIONS * 4))
        assert [l.value for l in labels] == EXPECTED * 4
        assert a.completed + b.completed == 14  # 28 prompts, 2 per request
        assert min(a.completed, b.completed) >= 5  # equally fast servers share the work
        assert a.max_in_flight == b.max_in_flight == 2  # both kept full
        metrics = client.metrics()
        assert (metrics["server/0/requests"], metrics["server/1/requests"]) == (a.completed, b.completed)
        assert metrics["servers_up"] == 2


def test_pool_takes_a_dead_server_out_and_probes_it_back():
    with FakeLLMServer() as a, FakeLLMServer() as b:
        client = make_client(None, base_url=[a.url, b.url], batch_size=1, max_concurrency=1,
                             circuit_failures=2, circuit_cooldown_s=60.0, probe_interval_s=0.05)
        b.stop()

        async def scenario():
            try:
                first = await client.annotate(CAPTIONS)  # b fails twice, its prompts go to a
                out = client.metrics()["server/1/up"]
                b.start()
                for _ in range(100):  # the health check brings b back (long before 60 s)
                    if client.available() and client.breaker.state == "closed" and \
                            client._endpoints[1].breaker.state != "open":
                        break
                    await asyncio.sleep(0.02)
                second = await client.annotate(CAPTIONS)
                return first, out, second
            finally:
                await client.aclose()

        first, out, second = run(scenario())
        assert [l.value for l in first] == EXPECTED and out == 0.0
        assert [l.value for l in second] == EXPECTED
        assert b.completed > 0 and client.metrics()["servers_up"] == 2
        assert client.recoveries == 1


def test_pool_urls_are_checked():
    with pytest.raises(ValueError, match="given twice"):
        OpenAIAnnotator(["localhost:1", "http://localhost:1/v1"], "m")
    with pytest.raises(ValueError, match="no LLM server"):
        OpenAIAnnotator([], "m")


# ---------------------------------------------------------------------------------- complete()
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_complete_sends_any_prompt_through_the_pool_and_returns_texts_or_failures(api):
    """complete() is the request machinery of annotate(): answer texts in order, per-prompt
    failures instead of exceptions, the caller's request settings in the payload."""
    with FakeLLMServer() as a, FakeLLMServer() as b:
        client = make_client(None, base_url=[a.url, b.url], api=api, batch_size=2, max_retries=0)
        prompts = [P.classification_messages(c, "default") for c in CAPTIONS]

        async def scenario():
            try:
                answers = await client.complete(prompts, max_tokens=64, temperature=0.7)
                payload = a.last_payload
                a.mode = b.mode = "http500"
                failed = await client.complete(prompts[:2])
                return answers, payload, failed, await client.complete([])
            finally:
                await client.aclose()

        answers, payload, failed, none = run(scenario())
    assert [parse_label(x.text) for x in answers] == EXPECTED and all(x.ok for x in answers)
    assert payload["max_tokens"] == 64 and payload["temperature"] == 0.7 and "stop" not in payload
    assert a.completed > 0 and b.completed > 0  # both servers of the pool answered
    assert [(x.ok, x.error, x.text) for x in failed] == [(False, "http 500", "")] * 2 and none == []
    assert client.metrics()["server_errors"] == (2 if api == "chat" else 1)


def test_record_parse_feeds_the_metrics_and_the_health_counters(server):
    client = make_client(server)

    async def scenario():
        try:
            return await client.complete([P.classification_messages("You kill the newt!", "default")])
        finally:
            await client.aclose()

    answer = run(scenario())[0]
    client.record_parse(True, answer)
    client.record_parse(False, answer)
    assert (client.stats.labelled, client.stats.unparsable) == (1, 1)
    m = client.metrics()
    assert m["unparsable"] == 1 and m["server/0/labels_per_s"] > 0
    assert client.recent()["unparsable"] == 1


def test_the_only_served_model_is_found_by_check():
    with FakeLLMServer(models=("Meta-Llama-3.1-8B-Instruct",)) as server:
        client = OpenAIAnnotator(server.url, None)
        assert client.model is None and client.provenance.model == ""
        assert run(client.complete([[{"role": "user", "content": "hi"}]]))[0].error.startswith("no model")
        run(check_and_close(client))
        assert client.model == "Meta-Llama-3.1-8B-Instruct"
        assert client.provenance.model == client.ranking_provenance.model == client.model
        assert client.text_style == "llama-3"  # chosen from the name once it is known
    with FakeLLMServer(models=("a", "b")) as server:
        with pytest.raises(AnnotatorUnavailable, match="serves 2 models"):
            run(check_and_close(OpenAIAnnotator(server.url, None)))
