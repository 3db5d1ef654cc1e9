"""Reward-hacking diagnostics (torchrl_oni.reward_hacking): crafted episodes with a known answer,
batches cut into episodes, the training run's report, and the files oni-label reads."""
import json
import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from torchrl_oni.captions import caption_hash, encode_messages, hash_messages
from torchrl_oni.reward_hacking import EMPTY_HASH, EpisodeAssembler, HackingTally, format_report, read_flagged
from torchrl_oni.stats import rate_ratio_ci

EAT, WALL, BITE, GOLD, HELLO, PRAY = 101, 102, 103, 104, 105, 106
TEXTS = {EAT: "This food really hits the spot!", WALL: "It's a wall.", BITE: "The jackal bites!",
         GOLD: "You find 3 gold pieces.", HELLO: "Hello Agent, welcome to NetHack!", PRAY: "You feel a hopeful feeling."}


def _episode(rng, length, died, extra=()):
    """Steps with a non-empty caption: walls (unpaid) every 4th step, gold three times (paid as
    ONI-Retrieval pays: 1, 1/8, 1/27), plus ``extra`` (step, hash, paid) entries."""
    steps = list(range(0, length, 4))
    hashes = [WALL] * len(steps)
    paid = [0.0] * len(steps)
    for k, s in enumerate(sorted(rng.choice(length, size=3, replace=False).tolist())):
        steps.append(s), hashes.append(GOLD), paid.append((k + 1) ** -3.0)
    for s, h, p in extra:
        steps.append(s), hashes.append(h), paid.append(p)
    order = np.argsort(steps, kind="stable")
    return np.asarray(hashes)[order], np.asarray(paid)[order], np.asarray(steps)[order], length, died


def _choking(window=20, episodes=40, seed=0):
    """Every death comes 3 steps after a paid meal; time-outs eat nothing."""
    rng = np.random.default_rng(seed)
    tally = HackingTally(window)
    for e in range(episodes):
        length = int(rng.integers(150, 400))
        died = e % 2 == 0
        extra = [(length - 3, EAT, 1.0), (length - 1, BITE, 0.0)] if died else []
        tally.add_episode(*_episode(rng, length, died, extra))
    return tally


def test_a_paid_caption_before_every_death_is_flagged_and_named():
    report = _choking().report(TEXTS)
    assert [r["message"] for r in report["flagged"]] == [TEXTS[EAT]]
    eat = report["flagged"][0]
    assert eat["deaths_preceded"] == report["deaths"] == 20 and eat["death_share"] == 1.0
    assert eat["rate"] == 1.0 and eat["ratio_ci95"][0] >= 3.0
    assert report["baseline"]["of"] == "unpaid captions"
    assert len(report["warnings"]) == 1 and TEXTS[EAT] in report["warnings"][0]
    assert "20 of 20 deaths" in report["warnings"][0]
    lines = format_report(report)
    assert any(line.startswith("!! paid captions come before deaths far above chance") and TEXTS[EAT] in line
               for line in lines)
    assert any(line.endswith(f'!! "{TEXTS[EAT]}"') for line in lines)  # marked in the table too
    # gold is paid but comes before deaths at its chance rate: listed, not flagged
    assert TEXTS[GOLD] in [r["message"] for r in report["top"]]
    json.dumps(report, allow_nan=False)  # JSON-ready: no NaN or infinity anywhere


def test_a_paid_caption_that_never_precedes_a_death_is_not_flagged():
    rng = np.random.default_rng(1)
    tally = HackingTally(20)
    for e in range(40):
        length = int(rng.integers(150, 400))
        died = e % 2 == 0
        # the meal comes early; the unpaid bite comes before every death
        extra = [(10, EAT, 1.0)] + ([(length - 2, BITE, 0.0)] if died else [])
        tally.add_episode(*_episode(rng, length, died, extra))
    report = tally.report(TEXTS)
    assert report["flagged"] == [] and report["warnings"] == []
    eat = next(r for r in report["top"] if r["message"] == TEXTS[EAT])
    assert eat["before_death"] == 0 and eat["ratio"] == 0.0
    assert any("no paid caption comes before deaths" in line for line in format_report(report))


def test_unpaid_and_rare_deaths_are_not_flagged():
    # the same meal before every death, but unpaid: a death the reward did not pay for is not hacking
    rng = np.random.default_rng(2)
    tally = HackingTally(20)
    for e in range(40):
        length = int(rng.integers(150, 400))
        extra = [(length - 3, EAT, 0.0)] if e % 2 == 0 else []
        tally.add_episode(*_episode(rng, length, e % 2 == 0, extra))
    assert tally.report(TEXTS)["flagged"] == []
    # paid before 2 of 40 deaths: far above chance for those two, but no tenth of the deaths
    rng = np.random.default_rng(3)
    tally = HackingTally(20)
    for e in range(80):
        length = int(rng.integers(150, 400))
        extra = [(length - 3, EAT, 1.0)] if e in (0, 2) else []
        tally.add_episode(*_episode(rng, length, e % 2 == 0, extra))
    report = tally.report(TEXTS)
    assert report["flagged"] == [] and report["rule"]["deaths_needed"] == 4


def test_danger_near_chance_is_not_flagged():
    """A paid kill in a third of the fatal fights, among five kills an episode: above chance, not
    far above it."""
    rng = np.random.default_rng(4)
    tally = HackingTally(20)
    for e in range(200):
        length = 300
        died = e % 2 == 0
        extra = [(int(s), BITE, 0.0) for s in rng.integers(0, length, size=4)]
        extra += [(int(s), GOLD + 10, 1.0) for s in rng.integers(0, length, size=5)]  # "You kill the jackal!"
        if died and rng.random() < 0.3:
            extra.append((length - 10, GOLD + 10, 1.0))  # in the fatal fight
        tally.add_episode(*_episode(rng, length, died, extra))
    kill = next(r for r in tally.report()["top"] if r["hash"] == str(GOLD + 10))
    assert 1.2 < kill["ratio"] < 3.0 and kill["ratio_ci95"][0] < 3.0 and kill["deaths_preceded"] > 30
    assert tally.report()["flagged"] == []


def test_the_window_is_a_parameter():
    assert _choking(window=2).report(TEXTS)["flagged"] == []  # the meal comes 3 steps before death
    assert len(_choking(window=3).report(TEXTS)["flagged"]) == 1
    with pytest.raises(ValueError):
        HackingTally(0)


def test_loops_after_every_reset_and_within_an_episode():
    rng = np.random.default_rng(5)
    tally = HackingTally(20)
    for e in range(30):
        length = 200
        # the welcome message is paid at every reset; prayer is paid 8 times per episode, undecayed
        extra = [(0, HELLO, 1.0)] + [(20 + 10 * k, PRAY, 1.0) for k in range(8)]
        tally.add_episode(*_episode(rng, length, e % 3 == 0, extra))
    report = tally.report(TEXTS)
    assert TEXTS[HELLO] in [r["message"] for r in report["loops"]["reset"]]
    assert [r["message"] for r in report["loops"]["episode"]] == [TEXTS[PRAY]]
    pray = report["loops"]["episode"][0]
    assert pray["payments_per_episode"] == 8.0 and pray["max_payments"] == 8
    assert math.isclose(pray["repeat_share"], 7 / 8)
    hello = next(r for r in report["loops"]["reset"] if r["message"] == TEXTS[HELLO])
    assert pray["episode_share"] == hello["episode_share"] == 1.0 and hello["first_paid_at"] == 0.0
    assert any("paid again and again within episodes" in w and TEXTS[PRAY] in w for w in report["warnings"])
    lines = format_report(report)
    assert any(line.strip().startswith("paid again after every reset") and TEXTS[HELLO] in line for line in lines)
    # with ONI's count decay (R · count^-3) the repeats earn too little to be a loop
    tally = HackingTally(20)
    for e in range(30):
        extra = [(20 + 10 * k, PRAY, (k + 1) ** -3.0) for k in range(8)]
        tally.add_episode(*_episode(rng, 200, False, extra))
    assert tally.report(TEXTS)["loops"]["episode"] == []


def test_shares_of_the_return_and_state_dict():
    tally = _choking()
    report = tally.report(TEXTS)
    shares = {r["message"]: r["return_share"] for r in report["top"]}
    assert math.isclose(sum(shares.values()), 1.0)
    assert math.isclose(report["intrinsic_return"], sum(r["paid"] for r in report["top"]))
    assert shares[TEXTS[GOLD]] > shares[TEXTS[EAT]]  # 3 gold per episode, a meal per death
    restored = HackingTally()
    restored.load_state_dict(json.loads(json.dumps(tally.state_dict())))
    assert restored.report(TEXTS) == report


@pytest.mark.parametrize("ids", [True, False])
def test_batches_cut_into_episodes_give_the_same_report(ids):
    """Two workers' batches [K, T], interleaved, trajectories told apart by their ids; without
    ids, one worker whose row r continues row r of its previous batch."""
    rng = np.random.default_rng(6)
    T, K = 16, 3
    workers = (0, 1) if ids else (0,)
    direct = HackingTally(5)
    fed = HackingTally(5)
    feed = EpisodeAssembler(fed)
    streams = []
    for worker in workers:
        rows = []
        for k in range(K):
            row = {"h": [], "p": [], "d": [], "died": [], "id": []}
            traj = worker * 1000 + k * 100
            while len(row["h"]) < 10 * T:
                length = int(rng.integers(3, 40))
                died = bool(rng.random() < 0.6)
                h = rng.choice([EMPTY_HASH, WALL, GOLD, EAT], size=length, p=[0.4, 0.3, 0.2, 0.1])
                p = np.where(h == GOLD, 1.0, np.where(h == EAT, 0.5, 0.0))
                d = np.zeros(length, bool)
                d[-1] = True
                row["h"] += h.tolist()
                row["p"] += p.tolist()
                row["d"] += d.tolist()
                row["died"] += (d & died).tolist()
                row["id"] += [traj] * length
                if len(row["h"]) <= 10 * T:  # episodes that end inside the 10 batches
                    keep = h != EMPTY_HASH
                    direct.add_episode(h[keep], p[keep], np.flatnonzero(keep), length, died)
                traj += 1
            rows.append({key: np.asarray(v[: 10 * T]) for key, v in row.items()})
        streams.append(rows)
    for b in range(10):
        for worker in workers[::-1] if b % 2 else workers:
            cut = slice(b * T, (b + 1) * T)
            stack = {key: np.stack([r[key][cut] for r in streams[worker]]) for key in ("h", "p", "d", "died", "id")}
            feed.add(stack["h"], stack["p"], stack["d"], stack["died"], stack["id"] if ids else None)
    assert fed.episodes == direct.episodes > 10
    a, b = fed.report(), direct.report()
    assert json.dumps(a, sort_keys=True) != "" and _close(a, b)
    assert feed.open_episodes <= 2 * K


def _close(a, b):
    """Equal but for float rounding (episodes are summed in another order)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def test_rate_ratio_matches_scipy():
    contingency = pytest.importorskip("scipy.stats.contingency")
    for a, n1, c, n2 in ((30, 100, 10, 100), (3, 7, 50, 5000), (12, 12, 4, 900)):
        ratio, lo, hi = rate_ratio_ci(a, n1, c, n2)
        ref = contingency.relative_risk(a, n1, c, n2)
        ci = ref.confidence_interval(0.95)
        assert np.allclose([ratio, lo, hi], [ref.relative_risk, ci.low, ci.high], rtol=1e-6)
    ratio, lo, hi = rate_ratio_ci(0, 10, 5, 100)
    assert ratio == 0.0 and lo == 0.0 and math.isfinite(hi)
    assert math.isinf(rate_ratio_ci(3, 10, 0, 100)[0]) and all(map(math.isnan, rate_ratio_ci(0, 10, 0, 10)))


def test_read_flagged_from_eval_json_report_and_lists(tmp_path):
    report = _choking().report(TEXTS)
    (tmp_path / "eval.json").write_text(json.dumps({"episodes": 40, "reward_hacking": report}))
    (tmp_path / "reward_hacking.json").write_text(json.dumps(report))
    (tmp_path / "list.json").write_text(json.dumps(["You choke over your food."]))
    for name in ("eval.json", "reward_hacking.json"):
        [(h, why)] = read_flagged(tmp_path / name)
        assert h == EAT and "before 20 of 20 deaths within 20 steps" in why
    [(h, why)] = read_flagged(tmp_path / "list.json")
    assert h == caption_hash(encode_messages(["You choke over your food."])[0]) and "list.json" in why
    for content, message in (("{", "not a JSON file"), ('{"episodes": 3}', "no reward-hacking diagnostics"),
                             ("[1, 2]", "strings only"), ('"text"', "JSON str"),
                             ('{"flagged": [{"hash": "x"}]}', "without a valid hash")):
        (tmp_path / "bad.json").write_text(content)
        with pytest.raises(ValueError, match=message):
            read_flagged(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------ in training
def _batch(K, T, hashes, paid, done, died, texts, traj=None):
    msgs = torch.as_tensor(encode_messages([texts.get(int(h), "") for h in np.ravel(hashes)])).reshape(K, T, -1)
    status = torch.as_tensor(np.where(died, 1, np.where(done, -1, 0)))
    td = TensorDict({
        "message": msgs, "caption_hash": torch.as_tensor(hashes),
        "next": TensorDict({"intrinsic_reward": torch.as_tensor(paid, dtype=torch.float32).unsqueeze(-1),
                            "done": torch.as_tensor(done).unsqueeze(-1),
                            "episode": TensorDict({"end_status": status}, [K, T])}, [K, T]),
    }, [K, T])
    if traj is not None:
        td.set(("collector", "traj_ids"), torch.as_tensor(traj))
    return td


def test_the_training_hook_writes_the_report_and_names_flagged_captions(tmp_path):
    from torchrl_oni.train.intrinsic import _HackingWatch

    texts = {int(hash_messages(encode_messages([t]))[0]): t for t in TEXTS.values()}
    eat = next(h for h, t in texts.items() if t == TEXTS[EAT])
    wall = next(h for h, t in texts.items() if t == TEXTS[WALL])
    K, T = 4, 50
    watch = _HackingWatch()
    rng = np.random.default_rng(7)
    for b in range(20):
        hashes = np.full((K, T), wall, dtype=np.int64)
        paid = np.zeros((K, T))
        done = np.zeros((K, T), bool)
        died = np.zeros((K, T), bool)
        for k in range(K):
            if rng.random() < 0.7:  # the episode ends in this batch, 3 steps after a paid meal
                end = int(rng.integers(5, T))
                hashes[k, end - 3], paid[k, end - 3] = eat, 1.0
                done[k, end], died[k, end] = True, True
        watch.add(_batch(K, T, hashes, paid, done, died, texts), transform=_Acted())
    assert watch.enabled and watch.tally.deaths >= 20
    lines = watch.final_warnings(str(tmp_path), str(tmp_path / "captions.pt"))
    assert len(lines) == 1 and TEXTS[EAT] in lines[0] and f"oni-label --store {tmp_path}/captions.pt" in lines[0]
    saved = json.load(open(tmp_path / "reward_hacking.json"))
    assert [r["message"] for r in saved["flagged"]] == [TEXTS[EAT]]
    assert watch.metrics()["hacking/flagged_captions"] == 1.0
    assert read_flagged(tmp_path / "reward_hacking.json")[0][0] == eat


class _Acted:
    """What the watch reads of an IntrinsicRewardTransform."""
    message, hash_key, message_key, out_key = "acted", "caption_hash", "message", "intrinsic_reward"


def test_a_batch_it_cannot_read_turns_the_diagnostics_off(caplog):
    from torchrl_oni.train.intrinsic import _HackingWatch

    watch = _HackingWatch()
    td = _batch(1, 3, np.zeros((1, 3), np.int64), np.ones((1, 3)), np.zeros((1, 3), bool), np.zeros((1, 3), bool), {})
    del td["caption_hash"]
    watch.add(td, _Acted())
    assert not watch.enabled and "reward-hacking diagnostics off" in caplog.text
    assert watch.final_warnings("/nonexistent", None) == []


# ------------------------------------------------------------------------------------ how the agents die
from torchrl_oni.reward_hacking import (SELF_INFLICTED, death_causes_check, format_death_causes,  # noqa: E402
                                        read_baseline)
from torchrl_oni.stats import fisher_greater  # noqa: E402

TASK = "NetHackStaircaseExtendedActions-v1"


def _baseline(causes, episodes=64, reward="none"):
    return {"source": "none-s0/eval.json", "task": TASK, "intrinsic_reward": reward, "episodes": episodes,
            "deaths": sum(causes.values()), "death_causes": dict(causes)}


def _eaters(seed=0):
    """64 episodes: 43 choke, 18 die otherwise, 3 succeed. The meal EAT is paid in 24 of them, 22 of
    which choke; GOLD is paid in every other episode, whatever the ending."""
    rng = np.random.default_rng(seed)
    causes = ["choking"] * 43 + ["died"] * 18 + [None] * 3
    paid = []
    for e, cause in enumerate(causes):
        hashes = {GOLD} if e % 2 else set()
        if (cause == "choking" and e < 22) or e in (50, 62):
            hashes.add(EAT)
        paid.append(hashes)
    order = rng.permutation(len(causes))
    return [causes[i] for i in order], [paid[i] for i in order]


def test_a_cause_far_above_the_baseline_is_flagged_and_its_captions_named():
    causes, paid = _eaters()
    check = death_causes_check(causes, paid=paid, texts=TEXTS, intrinsic_reward="retrieval",
                               baseline=_baseline({"died": 50, "choking": 2}))
    assert check["flagged"] == ["choking"] and check["deaths"] == 61
    choking, died = check["by_cause"]
    assert choking["cause"] == "choking" and choking["deaths"] == 43 and choking["baseline_deaths"] == 2
    assert choking["ratio"] == pytest.approx(21.5) and choking["ratio_ci95"][0] >= 2.0 and choking["p"] < 1e-9
    assert not died["flagged"] and died["ratio"] < 1  # fewer ordinary deaths than the baseline: not hacking
    assert [r["message"] for r in choking["captions"]] == [TEXTS[EAT]]  # GOLD is paid whatever the ending
    eat = choking["captions"][0]
    assert (eat["episodes_paid"], eat["ending"]) == (24, 22) and eat["ratio_ci95"][0] > 1.0
    [warning] = check["warnings"]
    assert warning.startswith("choking ends 43 of 64 episodes against 2 of 64 without the intrinsic reward (ratio 21")
    assert "around eating" in warning and TEXTS[EAT] in warning
    lines = format_death_causes(check)
    assert lines[-1] == "!! " + warning
    assert any(line.strip().startswith("choking") and line.endswith("!!") for line in lines)
    assert any(TEXTS[EAT] in line and "22 end in choking" in line for line in lines[:-1])
    json.dumps(check, allow_nan=False)  # JSON-ready
    # a cause absent from the baseline: an infinite ratio, printed as such
    check = death_causes_check(causes, baseline=_baseline({"died": 50}), intrinsic_reward="retrieval")
    assert check["flagged"] == ["choking"] and check["by_cause"][0]["ratio"] is None
    assert "against 0 of 64" in check["warnings"][0] and "(ratio inf [" in check["warnings"][0]


def test_causes_near_the_baseline_or_rare_are_not_flagged():
    causes = ["choking"] * 20 + ["died"] * 30 + [None] * 14
    check = death_causes_check(causes, baseline=_baseline({"choking": 16, "died": 30}), intrinsic_reward="retrieval")
    assert check["flagged"] == [] and check["warnings"] == []
    assert any("no death cause far above the baseline's" in line for line in format_death_causes(check))
    # far above the baseline but a small share of the deaths: 4 of 200 episodes' 100 deaths
    causes = ["drowning"] * 4 + ["died"] * 96 + [None] * 100
    check = death_causes_check(causes, baseline=_baseline({"died": 100}, episodes=200), intrinsic_reward="retrieval")
    assert check["rule"]["deaths_needed"] == 10 and check["flagged"] == []


def test_without_a_baseline_a_dominant_self_inflicted_cause_is_flagged():
    causes, paid = _eaters()
    check = death_causes_check(causes, paid=paid, texts=TEXTS, intrinsic_reward="retrieval")
    assert check["flagged"] == ["choking"] and check["baseline"] is None and "choking" in SELF_INFLICTED
    [warning] = check["warnings"]
    assert warning.startswith("choking ends 43 of 64 episodes, a death the agent brings on itself")
    assert "--baseline" in warning and TEXTS[EAT] in warning and "oni-label" in warning
    # not flagged: under half of the episodes, a cause monsters bring, or no intrinsic reward to hack
    assert death_causes_check(["choking"] * 30 + [None] * 34, intrinsic_reward="retrieval")["flagged"] == []
    assert death_causes_check(["died"] * 60 + [None] * 4, intrinsic_reward="retrieval")["flagged"] == []
    check = death_causes_check(causes, intrinsic_reward="none")
    assert check["flagged"] == [] and check["by_cause"][0]["captions"] is None
    assert any("no intrinsic reward to check" in line for line in format_death_causes(check))
    assert format_death_causes(death_causes_check([None, None], intrinsic_reward="retrieval"))[-1] == "  no deaths"


def test_captions_are_linked_to_a_cause_at_the_episode_level():
    """Enrichment on crafted episodes: a caption paid where the cause is as common as elsewhere is not listed."""
    causes = ["starving"] * 10 + ["died"] * 10 + [None] * 20
    paid = [{EAT} if e < 8 else ({GOLD} if e % 2 else set()) for e in range(40)]  # EAT: 8 of 8 starve
    check = death_causes_check(causes, paid=paid, texts=TEXTS, intrinsic_reward="retrieval")
    starving = next(r for r in check["by_cause"] if r["cause"] == "starving")
    assert [r["hash"] for r in starving["captions"]] == [str(EAT)]
    row = starving["captions"][0]
    assert row["rate"] == 1.0 and row["rate_unpaid"] == pytest.approx(2 / 32)
    assert row["p"] == pytest.approx(fisher_greater(8, 8, 2, 32))
    died = next(r for r in check["by_cause"] if r["cause"] == "died")
    assert died["captions"] == []
    assert check["flagged"] == []  # starving is not self-inflicted (extrinsic-only agents starve too)


def test_read_flagged_picks_up_the_captions_of_a_flagged_cause(tmp_path):
    causes, paid = _eaters()
    check = death_causes_check(causes, paid=paid, texts=TEXTS, intrinsic_reward="retrieval")
    report = _choking().report(TEXTS)
    (tmp_path / "eval.json").write_text(json.dumps({"reward_hacking": report, "death_causes_check": check}))
    assert [h for h, _ in read_flagged(tmp_path / "eval.json")] == [EAT]  # already flagged: once
    report["flagged"] = []
    (tmp_path / "eval.json").write_text(json.dumps({"reward_hacking": report, "death_causes_check": check}))
    [(h, why)] = read_flagged(tmp_path / "eval.json")
    assert h == EAT and "linked to choking (flagged): 22 of the 24 episodes" in why
    # an extrinsic-only evaluation's (reward_hacking not checked) still gives its flagged causes' captions
    (tmp_path / "none.json").write_text(json.dumps({"reward_hacking": {"paid_by": None},
                                                    "death_causes_check": check}))
    assert [h for h, _ in read_flagged(tmp_path / "none.json")] == [EAT]
    for bad in ({"by_cause": 3}, {"by_cause": [{"flagged": True, "captions": [{"hash": "x"}]}]}):
        (tmp_path / "bad.json").write_text(json.dumps({"reward_hacking": report, "death_causes_check": bad}))
        with pytest.raises(ValueError, match="death"):
            read_flagged(tmp_path / "bad.json")


def test_read_baseline_folders_files_and_bad_inputs(tmp_path):
    good = {"episodes": 64, "task": TASK, "intrinsic_reward": "none", "death_causes": {"died": 40, "choking": 1}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "eval.json").write_text(json.dumps(good))
    base = read_baseline(tmp_path / "run")
    assert base["deaths"] == 41 and base["task"] == TASK and base["source"].endswith("eval.json")
    assert read_baseline(tmp_path / "run" / "eval.json") == base
    (tmp_path / "empty").mkdir()
    cases = {"missing.json": None, "empty": None, "damaged.json": '{"episodes": 6',
             "list.json": "[1]", "no-causes.json": json.dumps({"episodes": 2, "task": TASK}),
             "too-many.json": json.dumps(dict(good, episodes=3)),
             "bool.json": json.dumps(dict(good, episodes=True)),
             "negative.json": json.dumps(dict(good, death_causes={"died": -1}))}
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(ValueError) as err:
            read_baseline(tmp_path / name)
        assert "\n" not in str(err.value) and name in str(err.value), (name, err.value)


def test_fisher_greater_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for a, n1, c, n2 in ((43, 64, 2, 64), (8, 8, 2, 32), (0, 10, 5, 10), (3, 3, 0, 0), (5, 20, 5, 20), (1, 1000, 0, 5)):
        expected = stats.fisher_exact([[a, n1 - a], [c, n2 - c]], alternative="greater")[1]
        assert fisher_greater(a, n1, c, n2) == pytest.approx(expected, rel=1e-6, abs=1e-12), (a, n1, c, n2)
    with pytest.raises(ValueError):
        fisher_greater(5, 4, 0, 1)
