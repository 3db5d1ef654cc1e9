"""Replay files, the HTML player (in a real headless Chromium) and the GIF of ``oni-replay``."""
import json
import shutil
import time

import numpy as np
import pytest

from helpers import wait_for
from torchrl_oni.captions import encode_message
from torchrl_oni.replay import (
    COLS,
    NETHACK_COLORS,
    ROWS,
    Episode,
    ReplayError,
    _glyphs,
    load_episode,
    main,
    render_html,
    save_episode,
    write_gif,
    write_html,
)

TRICKY = '<b>bold</b> & "quoted" </script>'  # a caption that must stay text, never markup


def _played_episode(steps: int = 40, seed: int = 5) -> Episode:
    """A real NetHack episode: seeded random actions, tty screens as NLE draws them."""
    from torchrl_oni.envs.tasks import OBSERVATION_KEYS, make_task

    game = make_task("score", observation_keys=tuple(OBSERVATION_KEYS) + ("tty_chars", "tty_colors", "tty_cursor"))
    rng = np.random.default_rng(seed)
    frames = {k: [] for k in ("tty_chars", "tty_colors", "tty_cursor", "message", "reward", "action")}

    def keep(obs, reward):
        for k in ("tty_chars", "tty_colors", "tty_cursor", "message"):
            frames[k].append(np.asarray(obs[k]).astype(np.uint8))
        frames["reward"].append(reward)
        frames["action"].append(-1)

    obs, _ = game.reset(seed=seed)
    keep(obs, 0.0)
    for _ in range(steps):
        action = int(rng.integers(len(game.actions)))
        frames["action"][-1] = action
        obs, reward, terminated, truncated, _ = game.step(action)
        keep(obs, reward)
        if terminated or truncated:
            break
    game.close()
    n = len(frames["reward"])
    message = np.stack(frames["message"])
    message[1] = encode_message(TRICKY)
    label = np.full(n, np.nan, np.float32)
    label[1], label[2] = 1.0, 0.0
    intrinsic = np.where(np.isnan(label), 0.0, label).astype(np.float32)
    return Episode(
        tty_chars=np.stack(frames["tty_chars"]),
        tty_colors=np.stack(frames["tty_colors"]) & np.uint8(15),
        tty_cursor=np.stack(frames["tty_cursor"]),
        message=message,
        msg_count=np.ones(n, np.int32),
        action=np.asarray(frames["action"], np.int16),
        reward=np.asarray(frames["reward"], np.float32),
        label=label,
        intrinsic_reward=intrinsic,
        meta={"task": "score", "episode": 0, "action_names": [a.name for a in game.actions],
              "stats": {"end": "timeout", "return": float(sum(frames["reward"]))}},
    )


@pytest.fixture(scope="module")
def episode_file(tmp_path_factory):
    return str(save_episode(tmp_path_factory.mktemp("replay") / "episode_000.npz", _played_episode()))


def test_save_load_roundtrip_without_pickles(episode_file):
    ep = load_episode(episode_file)
    again = _played_episode()
    for name in ("tty_chars", "tty_colors", "tty_cursor", "message", "action", "reward"):
        np.testing.assert_array_equal(getattr(ep, name), getattr(again, name))
    np.testing.assert_array_equal(np.isnan(ep.label), np.isnan(again.label))
    assert ep.meta["task"] == "score" and ep.meta["format"] == "torchrl_oni.Episode"
    assert ep.messages()[1] == TRICKY
    assert "welcome to NetHack" in ep.screen_lines(0)[0]
    with np.load(episode_file, allow_pickle=False) as data:  # plain arrays only
        assert all(data[k].dtype != object for k in data.files)


def test_load_rejects_bad_files(tmp_path, episode_file):
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(open(episode_file, "rb").read()[:500])
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, tty_chars=np.array([{"a": 1}], dtype=object))
    missing = tmp_path / "missing.npz"
    np.savez(missing, tty_chars=np.zeros((1, ROWS, COLS), np.uint8))
    for bad, words in ((tmp_path / "nope.npz", "no episode file"), (truncated, "not a readable"),
                       (pickled, "not a readable"), (missing, "missing")):
        with pytest.raises(ReplayError, match=words):
            load_episode(bad)
    ep = _played_episode(steps=3)
    ep.reward = ep.reward[:-1]
    with pytest.raises(ReplayError, match="reward"):
        save_episode(tmp_path / "short.npz", ep)


def test_html_is_self_contained_and_escapes_text(episode_file):
    ep = load_episode(episode_file)
    page = render_html(ep, title="a <title> & more")
    assert TRICKY not in page and "<b>bold" not in page
    assert "a &lt;title&gt; &amp; more" in page
    assert "http://" not in page and "https://" not in page and "src=" not in page  # nothing fetched
    data = page.split('<script type="application/json" id="replay-data">', 1)[1].split("</script>", 1)[0]
    decoded = json.loads(data)
    assert decoded["frames"] == ep.num_frames
    assert TRICKY in decoded["messages"] and decoded["labels"][decoded["msg"][1]] == 1.0


def _render_reference(chars, colors, masks):
    """Palette indices drawn cell by cell (the GIF writer composes them vectorised)."""
    _, h, w = masks.shape
    out = np.zeros((chars.shape[0] * h, chars.shape[1] * w), np.uint8)
    for r in range(chars.shape[0]):
        for c in range(chars.shape[1]):
            out[r * h:(r + 1) * h, c * w:(c + 1) * w] = np.where(masks[chars[r, c]], colors[r, c] % 16 + 1, 0)
    return out


def test_gif_frames_decode_to_the_screens(tmp_path, episode_file):
    from PIL import Image

    ep = load_episode(episode_file)
    path = write_gif(ep, tmp_path / "ep.gif", fps=20, font_size=12)
    masks, h, w = _glyphs(12)
    palette = np.array([(0, 0, 0)] + [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in NETHACK_COLORS], np.uint8)
    with Image.open(path) as gif:
        assert gif.n_frames == ep.num_frames
        assert gif.size == (COLS * w, (ROWS + 1) * h)
        assert gif.info["duration"] == 50
        for t in (0, 1, ep.num_frames // 2, ep.num_frames - 1):  # later frames are deltas on earlier ones
            gif.seek(t)
            rgb = np.asarray(gif.convert("RGB"))[: ROWS * h]
            expected = palette[_render_reference(ep.tty_chars[t], ep.tty_colors[t], masks)]
            np.testing.assert_array_equal(rgb, expected)
    assert (ep.tty_chars[0] != ord(" ")).any() and masks[ord("@")].any() and not masks[ord(" ")].any()


def test_cli_writes_html_beside_the_episode_and_reports_errors(tmp_path, episode_file, capsys):
    src = tmp_path / "episode_007.npz"
    shutil.copy(episode_file, src)
    assert main([str(src)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "episode_007.html")
    assert (tmp_path / "episode_007.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert main([str(src), "--gif", str(tmp_path / "only.gif")]) == 0
    assert (tmp_path / "only.gif").exists() and not (tmp_path / "only.html").exists()
    capsys.readouterr()
    for argv in ([str(tmp_path / "none.npz")], [str(src), "--fps", "0"], [str(src), "--gif", "x.gif", "--fps", "500"],
                 [str(src), "--bogus"], [str(src), "--gif", str(tmp_path / "g.gif"), "--start", "999"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("oni-replay: error: ") and err.count("\n") == 1, (argv, err)


# ---------------------------------------------------------------------- a real browser
def test_html_player_in_headless_chromium(tmp_path, episode_file, browser):
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    ep = load_episode(episode_file)
    page = write_html(ep, tmp_path / "ep.html", fps=30)
    driver = browser
    driver.get(page.resolve().as_uri())
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready === '1'"))
    screen = lambda: driver.execute_script("return document.getElementById('screen').textContent").split("\n")
    frame = lambda: int(driver.find_element(By.ID, "frame-counter").get_attribute("data-frame"))
    assert frame() == 0
    assert driver.find_element(By.ID, "frame-counter").text == f"frame 0 / {ep.num_frames - 1}"
    assert [line.rstrip() for line in screen()] == [line.rstrip() for line in ep.screen_lines(0)]

    # the caption with markup shows as text, with its label and reward beside it
    body = driver.find_element(By.TAG_NAME, "body")
    body.send_keys(Keys.ARROW_RIGHT)
    assert frame() == 1
    assert driver.find_element(By.ID, "message").text == TRICKY
    assert driver.execute_script("return document.querySelector('#message b, #log b') === null")
    assert driver.find_element(By.ID, "label").text.startswith("approved")
    assert driver.find_element(By.ID, "intrinsic").text == "1.0000"
    body.send_keys(Keys.ARROW_LEFT)
    assert frame() == 0

    # play: later frames follow, each screen the recorded one
    driver.find_element(By.ID, "play").click()
    wait_for(lambda: frame() >= 8)
    body.send_keys(Keys.SPACE)  # pause
    time.sleep(0.2)
    shown = frame()
    assert shown >= 8 and driver.execute_script("return document.body.dataset.playing") == "0"
    assert [line.rstrip() for line in screen()] == [line.rstrip() for line in ep.screen_lines(shown)]
    assert ep.screen_lines(shown) != ep.screen_lines(0)
    body.send_keys(Keys.END)
    assert frame() == ep.num_frames - 1

    shot = tmp_path / "shot.png"
    driver.save_screenshot(str(shot))
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    assert len(np.unique(pixels[:: 7], axis=0)) > 20  # text in several colours, not a blank page
    assert not [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
