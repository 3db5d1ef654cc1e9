"""The labelling page (torchrl_oni.feedback): JSON API, safety, oni-label, and a real headless browser."""
import io
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from helpers import page_ready, press, wait_for
from torchrl_oni.annotators.base import Provenance
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.feedback import FeedbackServer, ScreenSnapshots, serve_feedback
from torchrl_oni.store import CaptionStore

XSS = ['<script>window.__xss = 1</script>', '<img src=x onerror="window.__xss = 2">']
LLM = Provenance("openai", "some-llm", "cls-tagged-v1:default")


def _h(text):
    return int(hash_messages(encode_messages([text]))[0])


def _store(counts):
    """A store whose captions were seen ``counts[text]`` times."""
    store = CaptionStore(capacity=64)
    texts = [t for t, n in counts.items() for _ in range(n)]
    msgs = encode_messages(texts)
    store.add(msgs, hash_messages(msgs))
    return store


def _label_of(store, text):
    rows = store.labelled_data()
    hashes = rows["caption_hash"].tolist()
    h = _h(text)
    return float(rows["label"][hashes.index(h)]) if h in hashes else None


def _provenance_of(store, text):
    slot = int(store.slots([_h(text)])[0])
    pid = int(store.caption_rows([slot], ["provenance"])["provenance"][0])
    return None if pid < 0 else store.provenances[pid].annotator


def _call(server, path, body=None, headers=None, method=None):
    """(status, JSON) of a request; the token is sent when the server has one."""
    hdrs = dict(headers or {})
    if server.token and "X-ONI-Token" not in hdrs:
        hdrs["X-ONI-Token"] = server.token
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    url = f"http://127.0.0.1:{server.port}{path}"
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw.decode("latin-1")


@pytest.fixture
def page():
    store = _store({"You kill the newt!": 5, "It's a wall.": 9, "": 50, "You find a hidden door.": 2,
                    "12 gold pieces.": 3})
    store.set_labels([_h("You kill the newt!")], [1.0], LLM)
    with serve_feedback(store, port=0, announce=False) as server:
        yield store, server


# ------------------------------------------------------------------------------------ JSON API
def test_queue_is_most_seen_first_without_empty_or_human_captions(page):
    store, server = page
    status, queue = _call(server, "/api/queue?kind=captions&limit=10")
    assert status == 200
    assert [x["text"] for x in queue["items"]] == ["It's a wall.", "You kill the newt!", "12 gold pieces.",
                                                   "You find a hidden door."]
    assert queue["items"][1]["llm"] == {"label": 1.0, "by": "openai:some-llm"}
    assert queue["items"][0]["llm"] is None and queue["items"][0]["times_seen"] == 9
    assert queue["items"][0]["id"] == str(_h("It's a wall."))  # a string: int64 does not fit a JS number
    status, answer = _call(server, "/api/label", {"id": queue["items"][0]["id"], "answer": "not_progress"})
    assert status == 200 and answer["given"] == 1 and answer["human_total"]["captions"] == 1
    assert _label_of(store, "It's a wall.") == 0.0 and _provenance_of(store, "It's a wall.") == "human"
    _, queue = _call(server, "/api/queue?kind=captions")
    assert "It's a wall." not in [x["text"] for x in queue["items"]]
    assert server.metrics()["human_labels"] == 1.0


def test_agreement_undo_and_skip(page):
    store, server = page
    kill = str(_h("You kill the newt!"))
    _, state = _call(server, "/api/label", {"id": kill, "answer": "not_progress"})  # the LLM said progress
    assert state["agreement"]["caption"] == {"compared": 1, "agree": 0, "series": [[1, 0.0]]}
    assert _provenance_of(store, "You kill the newt!") == "human"
    status, undone = _call(server, "/api/undo", {})
    assert status == 200 and undone["undone"] == {"kind": "caption", "id": kill, "answer": "not_progress",
                                                  "restored": True}
    # the LLM's label and provenance are back, and the comparison is forgotten
    assert _label_of(store, "You kill the newt!") == 1.0 and _provenance_of(store, "You kill the newt!") == "openai"
    assert undone["agreement"]["caption"]["compared"] == 0 and undone["given"] == 0
    _call(server, "/api/label", {"id": kill, "answer": "progress"})
    assert server.state()["agreement"]["caption"]["agree"] == 1
    # undo of a label on a caption that had none: unlabelled again
    gold = str(_h("12 gold pieces."))
    _call(server, "/api/label", {"id": gold, "answer": "progress"})
    _call(server, "/api/undo", {})
    assert _label_of(store, "12 gold pieces.") is None and store.stats()["unseen"] >= 1
    # skip: gone from this session's queue, back after undo; the store is untouched
    wall = str(_h("It's a wall."))
    _call(server, "/api/label", {"id": wall, "answer": "skip"})
    assert wall not in [x["id"] for x in _call(server, "/api/queue")[1]["items"]]
    _call(server, "/api/undo", {})
    assert wall in [x["id"] for x in _call(server, "/api/queue")[1]["items"]]
    _call(server, "/api/undo", {})  # the "progress" on the newt
    assert _call(server, "/api/undo", {})[0] == 409


def test_undo_keeps_a_label_written_since(page):
    store, server = page
    gold = _h("12 gold pieces.")
    _call(server, "/api/label", {"id": str(gold), "answer": "progress"})
    store.set_labels([gold], [0.0], Provenance("human", "grace", "feedback-v1"))  # another person, since
    status, undone = _call(server, "/api/undo", {})
    assert status == 200 and undone["undone"]["restored"] is False
    assert _label_of(store, "12 gold pieces.") == 0.0 and _provenance_of(store, "12 gold pieces.") == "human"


@pytest.mark.parametrize("path,body,headers,status,message", [
    ("/api/label", b"{not json", None, 400, "not valid JSON"),
    ("/api/label", b"[1, 2]", None, 400, "JSON object"),
    ("/api/label", {"id": "12", "answer": "progress"}, None, 400, "unknown caption"),
    ("/api/label", {"id": "1e9", "answer": "progress"}, None, 400, "decimal string"),
    ("/api/label", {"id": 5, "answer": "progress"}, None, 400, "unknown caption"),
    ("/api/label", {"id": str(2 ** 64), "answer": "progress"}, None, 400, "out of range"),
    ("/api/label", {"id": None, "answer": "progress"}, None, 400, "decimal string"),
    ("/api/label", {"id": "WALL", "answer": "maybe"}, None, 400, "answer must be one of"),
    ("/api/label", {"id": "WALL", "answer": "progress"}, {"Content-Type": "text/plain"}, 415, "JSON"),
    ("/api/label", {"id": "WALL", "answer": "progress"}, {"Origin": "http://evil.example"}, 403, "cross-origin"),
    ("/api/prefer", {"id": "0", "answer": "left"}, None, 400, "unknown pair"),
    ("/api/prefer", {"id": "0", "answer": "up"}, None, 400, "answer must be one of"),
    ("/api/queue?kind=videos", None, None, 400, "kind must be"),
    ("/api/queue?limit=1000", None, None, 400, "limit must be"),
    ("/api/screen?id=42", None, None, 404, "no screen"),
    ("/api/nothing", None, None, 404, "Not Found"),
    ("/api/state", None, {"Host": "attacker.example:80"}, 403, "Host header"),
])
def test_bad_requests_get_json_errors(page, path, body, headers, status, message):
    store, server = page
    if isinstance(body, dict) and body.get("id") == "WALL":
        body = dict(body, id=str(_h("It's a wall.")))
    got, answer = _call(server, path, body, headers)
    assert got == status and message in answer["error"], answer
    assert store.stats()["labelled"] == 1  # nothing was written


def test_pairs_preferences_and_undo(page):
    store, server = page
    store.add_pairs([_h("It's a wall."), _h("You kill the newt!")], [_h("12 gold pieces."), _h("It's a wall.")])
    store.set_preferences([1], [0.0], LLM)
    _, queue = _call(server, "/api/queue?kind=pairs")
    assert [(x["left"]["text"], x["right"]["text"]) for x in queue["items"]] == [
        ("It's a wall.", "12 gold pieces."), ("You kill the newt!", "It's a wall.")]
    assert queue["items"][1]["llm"] == {"preference": 0.0, "by": "openai:some-llm"}
    _call(server, "/api/prefer", {"id": "0", "answer": "right"})
    _, state = _call(server, "/api/prefer", {"id": "1", "answer": "equal"})
    assert state["agreement"]["pair"]["compared"] == 1 and state["agreement"]["pair"]["agree"] == 0
    pairs = store.sample_labelled_pairs(64, generator=np.random.default_rng(0))
    assert set(pairs["preference"].tolist()) == {1.0, 0.5}
    _call(server, "/api/undo", {})
    assert _call(server, "/api/queue?kind=pairs")[1]["items"][0]["llm"]["preference"] == 0.0
    assert state["human_total"]["pairs"] == 2 and server.state()["human_total"]["pairs"] == 1


def test_queue_follows_ensemble_disagreement_when_a_scorer_is_given():
    from torchrl_oni.captions import decode_messages

    store = _store({"calm": 9, "disputed": 1, "mild": 5})
    store.add_pairs([_h("calm"), _h("mild")], [_h("mild"), _h("disputed")])
    spread = {"calm": [0.1, 0.1], "disputed": [0.0, 1.0], "mild": [0.2, 0.5]}

    def scorer(messages):
        return torch.tensor([spread[t] for t in decode_messages(messages)])

    def pair_scorer(first, second):
        a, b = scorer(first), scorer(second)
        return torch.sigmoid(b - a)

    with serve_feedback(store, port=0, scorer=scorer, pair_scorer=pair_scorer, announce=False) as server:
        _, queue = _call(server, "/api/queue")
        assert [x["text"] for x in queue["items"]] == ["disputed", "mild", "calm"]
        _, pairs = _call(server, "/api/queue?kind=pairs")
        assert [x["id"] for x in pairs["items"]] == ["1", "0"]  # (mild, disputed) is the more disputed pair
        assert server.state()["order"] == "disagree"


def test_flagged_captions_come_first_with_why_until_a_person_labels_them():
    store = _store({"It's a wall.": 9, "You finish eating the food ration.": 1, "You kill the newt!": 5,
                    "You feel better.": 2})
    first = [(_h("You feel better."), "flagged: before 3 of 4 deaths"),
             (_h("You finish eating the food ration."), "flagged: before 4 of 4 deaths"),
             (_h("never seen by this store"), "flagged elsewhere")]
    with serve_feedback(store, port=0, announce=False, first=first) as server:
        _, queue = _call(server, "/api/queue?kind=captions&limit=10")
        assert [x["text"] for x in queue["items"]] == ["You feel better.", "You finish eating the food ration.",
                                                       "It's a wall.", "You kill the newt!"]
        assert queue["items"][0]["note"] == "flagged: before 3 of 4 deaths" and "note" not in queue["items"][2]
        assert server.state()["first"] == 2
        _, queue = _call(server, "/api/queue?kind=captions&limit=1")
        assert [x["text"] for x in queue["items"]] == ["You feel better."]
        _call(server, "/api/label", {"id": str(_h("You feel better.")), "answer": "not_progress"})
        _, queue = _call(server, "/api/queue?kind=captions&limit=2")
        assert [x["text"] for x in queue["items"]] == ["You finish eating the food ration.", "It's a wall."]
        assert server.state()["first"] == 1
    with serve_feedback(store, port=0, announce=False) as server:  # without: most seen first
        _, queue = _call(server, "/api/queue?kind=captions&limit=1")
        assert queue["items"][0]["text"] == "It's a wall." and server.state()["first"] == 0


def test_oni_label_puts_the_eval_json_flagged_captions_first(tmp_path, capsys, monkeypatch):
    from torchrl_oni.feedback import cli

    store = _store({"It's a wall.": 9, "You finish eating the food ration.": 1})
    path = store.save(tmp_path / "captions.pt")
    eat = _h("You finish eating the food ration.")
    flagged = {"window": 20, "deaths": 4, "baseline": {"of": "unpaid captions"},
               "flagged": [{"hash": str(eat), "deaths_preceded": 4, "ratio": 12.5}]}
    (tmp_path / "eval.json").write_text(json.dumps({"episodes": 8, "reward_hacking": flagged}))
    seen = []

    class Started(Exception):
        pass

    def start(self, *args, **kwargs):
        seen.append(dict(self.first))
        raise Started

    monkeypatch.setattr(FeedbackServer, "start", start)
    for argv, expected in (([], {eat: "flagged: before 4 of 4 deaths within 20 steps, 12.5x the rate of unpaid "
                                       "captions"}),
                           (["--first", "none"], {})):
        with pytest.raises(Started):
            cli.main(["--store", str(path), "--port", "0", *argv])
        assert seen[-1] == expected
    (tmp_path / "eval.json").write_text("{broken")  # found, not asked for: said, and the page still opens
    with pytest.raises(Started):
        cli.main(["--store", str(path), "--port", "0"])
    assert seen[-1] == {} and "not putting flagged captions first" in capsys.readouterr().out
    (tmp_path / "mine.json").write_text(json.dumps(["It's a wall."]))
    with pytest.raises(Started):
        cli.main(["--store", str(path), "--port", "0", "--first", str(tmp_path / "mine.json")])
    assert seen[-1] == {_h("It's a wall."): "listed in mine.json"}


def test_a_later_llm_label_does_not_overwrite_a_human_one(page):
    store, server = page
    wall = _h("It's a wall.")
    _call(server, "/api/label", {"id": str(wall), "answer": "progress"})
    assert store.set_labels([wall], [0.0], LLM).tolist() == [False]  # what AnnotationWorker does when the LLM answers late
    assert _label_of(store, "It's a wall.") == 1.0 and _provenance_of(store, "It's a wall.") == "human"
    # the same for pairs
    store.add_pairs([wall], [_h("You kill the newt!")])
    _call(server, "/api/prefer", {"id": "0", "answer": "left"})
    assert store.set_preferences([0], [1.0], LLM).tolist() == [False]
    assert store.pair_rows([0])["preference"].tolist() == [0.0]
    # undo puts the caption back where it was: unlabelled, so the LLM is asked again
    _call(server, "/api/undo", {})
    _call(server, "/api/undo", {})
    assert _label_of(store, "It's a wall.") is None
    assert store.set_labels([wall], [0.0], LLM).tolist() == [True]


# ------------------------------------------------------------------------------------ safety
def test_off_loopback_needs_a_token():
    store = _store({"It's a wall.": 1})
    with pytest.raises(ValueError, match="without an access token"):
        FeedbackServer(store, host="0.0.0.0", port=0, token="")
    with pytest.raises(ValueError, match="at least 16"):
        FeedbackServer(store, host="0.0.0.0", port=0, token="short")
    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        server = serve_feedback(store, host="0.0.0.0", port=0)
    finally:
        sys.stderr = sys_stderr
    try:
        assert server.token and len(server.token) >= 24
        assert err.getvalue().count(server.token) == 1  # printed once
        assert _call(server, "/api/state", headers={"X-ONI-Token": "wrong" * 5})[0] == 401
        status, answer = _call(server, "/api/state", headers={"X-ONI-Token": ""})
        assert status == 401 and "token" in answer["error"]
        assert _call(server, "/api/state")[0] == 200  # with the token
        # the page itself has no data; any Host is fine off loopback (the token is the gate)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=20) as resp:
            html = resp.read().decode()
            assert "ONI labelling" in html and "script-src 'self'" in resp.headers["Content-Security-Policy"]
    finally:
        server.stop()
    assert FeedbackServer(store, port=0, announce=False).token is None  # loopback: none by default


def test_port_in_use_is_an_oserror():
    store = _store({"a": 1})
    with serve_feedback(store, port=0, announce=False) as first:
        with pytest.raises(OSError):
            FeedbackServer(store, port=first.port, announce=False).start()


# ------------------------------------------------------------------------------------ screens
def test_screen_snapshots_bounded_pinned_and_saved(tmp_path):
    snaps = ScreenSnapshots(capacity=3)
    chars = np.full((5, 24, 80), ord("."), np.uint8)
    for i in range(5):
        chars[i, 0, 0] = ord("A") + i
    colors = np.arange(5 * 24 * 80).reshape(5, 24, 80).astype(np.int8)  # int8 like NLE
    snaps.pin([1])
    assert snaps.offer([1, 2, 3], chars[:3], colors[:3]) == 3
    assert snaps.offer([4, 5], chars[3:], colors[3:]) == 2  # evicts 2 and 3, never the pinned 1
    assert [h in snaps for h in range(1, 6)] == [True, False, False, True, True]
    assert snaps.offer([1], chars[4:], colors[4:]) == 0 and snaps.text(1)[0] == "A"  # first screen kept
    np.testing.assert_array_equal(snaps.get(4)[1], np.clip(colors[3], 0, 255).astype(np.uint8))
    path = snaps.save(tmp_path / "s.pt")
    again = ScreenSnapshots.load(path)
    assert len(again) == 3 and again.text(5) == snaps.text(5)
    again.offer([6, 7], chars[:2], colors[:2])
    assert 1 in again and 4 not in again  # pins survive the round trip
    torch.save({"format": "something else"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a ScreenSnapshots"):
        ScreenSnapshots.load(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"\[2, 24, 80\]"):
        snaps.offer([8, 9], chars[:1], colors[:1])


# ------------------------------------------------------------------------------------ oni-label
def test_oni_label_serves_saves_and_exits_cleanly(tmp_path, capsys, monkeypatch):
    from torchrl_oni.feedback import cli

    store = _store({"You kill the newt!": 3, "It's a wall.": 5})
    path = store.save(tmp_path / "captions.pt")
    started = []
    real_start = FeedbackServer.start

    def start(self, *args, **kwargs):
        started.append(self)
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(FeedbackServer, "start", start)
    seen = {}

    def person():  # answers once the page is up, waits for the save, then presses Ctrl-C
        try:
            server = wait_for(lambda: started and started[0].running and started[0])
            seen["status"] = _call(server, "/api/label", {"id": str(_h("It's a wall.")), "answer": "progress"})[0]
            seen["saved_while_serving"] = wait_for(lambda: _label_of(CaptionStore.load(path), "It's a wall.") == 1.0)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    helper = threading.Thread(target=person)
    helper.start()
    code = cli.main(["--store", str(path), "--port", "0", "--save-every", "0.1", "--labeller", "ada"])
    helper.join(30)
    out = capsys.readouterr().out
    assert code == 0 and seen == {"status": 200, "saved_while_serving": True}
    assert "oni-label: 2 captions, 2 waiting for a person" in out and "saved" in out and "1 answers" in out
    assert CaptionStore.load(path).provenances == [Provenance("human", "ada", "feedback-v1")]


def test_oni_label_stopped_while_the_page_starts_saves_and_exits_cleanly(tmp_path, capsys, monkeypatch):
    from torchrl_oni.feedback import cli

    path = _store({"You kill the newt!": 3}).save(tmp_path / "captions.pt")
    real_start = FeedbackServer.start

    def start(self, *args, **kwargs):  # Ctrl-C arrives while the page is still starting
        os.kill(os.getpid(), signal.SIGINT)
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(FeedbackServer, "start", start)
    code = cli.main(["--store", str(path), "--port", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "saved" in out and "0 answers" in out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back


@pytest.mark.parametrize("argv,message", [
    (["--host", "0.0.0.0", "--token", "short"], "at least 16 characters"),
    (["--port", "70000"], "--port must be in"),
    (["--screens", "/nonexistent/screens.pt"], "no ScreenSnapshots file"),
    (["--first", "/nonexistent/eval.json"], "--first: cannot read"),
    (["--bogus"], "unrecognized arguments"),
])
def test_oni_label_errors_are_one_line(tmp_path, capsys, argv, message):
    from torchrl_oni.feedback import cli

    path = _store({"a": 1}).save(tmp_path / "captions.pt")
    with pytest.raises(SystemExit) as stop:
        cli.main(["--store", str(path), *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("oni-label: error: ") and message in err


def test_oni_label_port_in_use(tmp_path, capsys):
    from torchrl_oni.feedback import cli

    path = _store({"a": 1}).save(tmp_path / "captions.pt")
    with serve_feedback(CaptionStore(capacity=4), port=0, announce=False) as busy:
        with pytest.raises(SystemExit) as stop:
            cli.main(["--store", str(path), "--port", str(busy.port)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"oni-label: error: cannot listen on 127.0.0.1:{busy.port}")


# ------------------------------------------------------------------------------------ a real browser
def _nle_screen():
    from nle import nethack

    nh = nethack.Nethack(observation_keys=("tty_chars", "tty_colors", "message"), ttyrec=None)
    try:
        chars, colors, message = nh.reset()
        return chars.copy(), colors.copy(), bytes(message).split(b"\0")[0].decode("latin-1")
    finally:
        nh.close()


def test_browser_labels_with_the_keyboard_and_renders_the_screen(browser):
    from PIL import Image
    from selenium.webdriver.common.by import By

    chars, colors, welcome = _nle_screen()
    store = _store({welcome: 20, "You kill the newt!": 10, "It's a wall.": 4})
    store.set_labels([_h("You kill the newt!")], [1.0], LLM)
    snaps = ScreenSnapshots(capacity=8)
    snaps.offer([_h(welcome)], chars[None], colors[None])
    with serve_feedback(store, port=0, snapshots=snaps, announce=False) as server:
        browser.get(server.url)
        wait_for(lambda: page_ready(browser))
        message = browser.find_element(By.ID, "message")
        assert message.text == welcome and message.is_displayed()
        assert browser.find_element(By.ID, "counter").text == "0 labels given"
        # the screen: 24 rows of NetHack's terminal, coloured spans, the welcome line on top
        screen = wait_for(lambda: browser.find_element(By.ID, "screen").text)
        assert screen.splitlines()[0].startswith("Hello Agent, welcome to NetHack!")
        classes = browser.execute_script(
            "return Array.from(document.querySelectorAll('#screen span')).map(s => s.className)")
        assert len(set(classes)) >= 3 and all(c.startswith("c") for c in classes)
        png = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("L")
        assert np.asarray(png).std() > 20  # not a blank page
        box = np.asarray(Image.open(io.BytesIO(message.screenshot_as_png)).convert("L"))
        assert box.std() > 10 and box.min() < 100  # dark caption text on the light card
        tty = np.asarray(Image.open(io.BytesIO(browser.find_element(By.ID, "screen").screenshot_as_png)).convert("L"))
        assert tty.mean() < 80 and tty.max() > 150  # light characters on the black terminal

        press(browser, "n")  # not progress
        wait_for(lambda: browser.find_element(By.ID, "counter").text == "1 label given")
        assert _label_of(store, welcome) == 0.0 and _provenance_of(store, welcome) == "human"
        wait_for(lambda: browser.find_element(By.ID, "message").text == "You kill the newt!")
        llm = browser.find_element(By.ID, "llm")
        assert not llm.is_displayed()  # hidden by default: no anchoring
        press(browser, "l")
        wait_for(lambda: llm.is_displayed())
        assert llm.text == "progress (openai:some-llm)"
        press(browser, "p")
        wait_for(lambda: browser.find_element(By.ID, "counter").text == "2 labels given")
        assert _label_of(store, "You kill the newt!") == 1.0
        wait_for(lambda: browser.find_element(By.ID, "agreement-text").text.startswith("Agree: captions 100% of 1"))
        assert browser.find_elements(By.CSS_SELECTOR, "#agreement-plot svg polyline")
        wait_for(lambda: page_ready(browser))
        press(browser, "u")  # undo
        wait_for(lambda: browser.find_element(By.ID, "counter").text == "1 label given")
        assert _provenance_of(store, "You kill the newt!") == "openai"
        wait_for(lambda: page_ready(browser))
        press(browser, "s")  # skip: nothing written
        wait_for(lambda: browser.find_element(By.ID, "message").text == "It's a wall.")
        assert _provenance_of(store, "You kill the newt!") == "openai" and store.stats()["labelled"] == 2


def test_browser_shows_markup_as_text_and_runs_none_of_it(browser):
    from selenium.webdriver.common.by import By

    store = _store({XSS[0]: 9, XSS[1]: 8, "You kill the newt!": 1})
    with serve_feedback(store, port=0, announce=False) as server:
        browser.get(server.url)
        wait_for(lambda: page_ready(browser))
        message = browser.find_element(By.ID, "message")
        assert message.text == XSS[0]
        upcoming = browser.find_element(By.ID, "upcoming").text.splitlines()
        assert upcoming[0] == XSS[1]
        assert browser.execute_script("return document.querySelectorAll('main img, #message script').length") == 0
        time.sleep(0.3)  # an onerror handler would have fired by now
        assert browser.execute_script("return window.__xss === undefined")
        press(browser, "p")
        wait_for(lambda: browser.find_element(By.ID, "message").text == XSS[1])
        assert _label_of(store, XSS[0]) == 1.0
        assert browser.execute_script("return window.__xss === undefined")


def test_browser_pairs_with_arrow_keys_and_token(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    store = _store({"You kill the newt!": 2, "It's a wall.": 3, "12 gold pieces.": 1})
    store.add_pairs([_h("It's a wall.")], [_h("You kill the newt!")])
    token = "t" * 8 + "0123456789abcdef"
    with serve_feedback(store, port=0, token=token, announce=False) as server:
        browser.get(server.url_with_token)
        wait_for(lambda: page_ready(browser))
        assert "token" not in browser.current_url  # dropped from the address bar
        press(browser, "v")
        wait_for(lambda: browser.find_element(By.ID, "left-message").text == "It's a wall.")
        assert browser.find_element(By.ID, "right-message").text == "You kill the newt!"
        wait_for(lambda: page_ready(browser))
        press(browser, Keys.ARROW_RIGHT)
        wait_for(lambda: browser.find_element(By.ID, "counter").text == "1 label given")
        pairs = store.sample_labelled_pairs(4, generator=np.random.default_rng(0))
        assert pairs["preference"].tolist() == [1.0] * 4
        assert int(store.stats()["pairs_labelled"]) == 1
        wait_for(lambda: browser.find_element(By.ID, "empty").is_displayed())


# ---------------------------------------------------------------------------------------------
# read timeouts (raw sockets), as oni-serve's: a client that never finishes sending
# ---------------------------------------------------------------------------------------------
def test_slow_request_heads_and_bodies_time_out():
    import socket

    server = FeedbackServer(_store({"You kill the newt!": 2}), port=0, announce=False, read_timeout=0.5).start()
    try:
        head = b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(6)]
        for sock in stalled:
            sock.sendall(head[:20])
        with urllib.request.urlopen(server.url + "api/state", timeout=5) as reply:  # others are served
            assert reply.status == 200
        start = time.monotonic()
        for sock in stalled:
            sock.settimeout(5)
            assert sock.recv(4096) == b""  # closed by the server
            sock.close()
        assert time.monotonic() - start < 4.0
        body = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        body.sendall(b"POST /api/label HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{\"hash\": ")
        body.settimeout(5)
        reply = body.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        body.close()
    finally:
        server.stop()


def test_a_server_is_running_only_once_its_port_is_known(monkeypatch):
    """Another thread that sees the page running may call it: ``running`` waits for the port
    (the app thread serves a moment before ``start`` has copied its port)."""
    from torchrl_oni.feedback import server as server_module

    seen = []

    class Watched(server_module.AppThread):
        def start(self, *args, **kwargs):
            super().start(*args, **kwargs)
            seen.append(page.running)  # serving, but start() has not copied the port yet

    monkeypatch.setattr(server_module, "AppThread", Watched)
    page = FeedbackServer(_store({"You kill the newt!": 3}), port=0, announce=False)
    page.start()
    try:
        assert seen == [False] and page.running and page.port
        assert _call(page, "/api/state")[0] == 200
    finally:
        page.stop()
    assert not page.running
