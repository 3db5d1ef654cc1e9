"""BALROG's progression (torchrl_oni.progression): the table as shipped, and the look-up checked
against values read by hand from BALROG's achievements.json."""
import json
import re
from pathlib import Path

import pytest

from torchrl_oni.progression import TABLE_FILE, progression, progression_table

ROOT = Path(__file__).resolve().parent.parent

# read off balrog-ai/BALROG balrog/environments/nle/achievements.json ("Dlvl:N", "Xp:N")
DLVL = {2: 0.015392269075361172, 3: 0.017539535798967013, 4: 0.021221378364235505, 5: 0.026482449457437766,
        10: 0.12558597019922987, 50: 0.8067964442444019}
XP = {6: 0.036887590648350246, 7: 0.0507583712345433, 10: 0.17909953770432294, 14: 0.49403949403949404,
      30: 0.7804561949196475}


@pytest.mark.parametrize("dlvl, xlvl, expected", [
    (1, 1, 0.0),  # where every game starts
    (2, 1, DLVL[2]),  # the dungeon level alone
    (1, 6, XP[6]),  # the experience level alone
    (5, 6, XP[6]),  # both: the larger, here the experience level's (3.7 % against 2.6 %)
    (10, 6, DLVL[10]),  # both: the larger, here the dungeon level's (12.6 % against 3.7 %)
    (2, 10, XP[10]),
    (50, 30, DLVL[50]),  # the last entries of both tables
    (51, 1, 0.0),  # beyond the dungeon table: counts 0, as BALROG skips a level it lacks
    (51, 14, XP[14]),  # ... and the experience level decides
    (3, 31, DLVL[3]),  # beyond the experience table (NetHack's highest level is 30)
    (0, 0, 0.0),  # below both tables
])
def test_progression_is_the_larger_of_the_two_looked_up_shares(dlvl, xlvl, expected):
    assert progression(dlvl, xlvl) == expected


def test_the_table_is_balrogs_and_says_where_it_came_from():
    table = progression_table()
    assert progression_table() is table  # read once
    dungeon, xp = table["dungeon_level"], table["experience_level"]
    assert sorted(dungeon) == list(range(1, 51)) and sorted(xp) == list(range(1, 31))
    assert dungeon[1] == xp[1] == 0.0
    assert all(dungeon[k] == v for k, v in DLVL.items()) and all(xp[k] == v for k, v in XP.items())
    # never decreasing: the value at the deepest (highest) level is the largest over those passed
    for levels in (dungeon, xp):
        values = [levels[k] for k in sorted(levels)]
        assert values == sorted(values) and 0.0 <= values[0] and values[-1] < 1.0
    source = table["source"]
    assert source["repository"] == "https://github.com/balrog-ai/BALROG"
    assert source["file"] == "balrog/environments/nle/achievements.json"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert set(json.loads(TABLE_FILE.read_text())) == {"source", "dungeon_level", "experience_level"}


def test_setup_ships_the_table():
    setup = (ROOT / "setup.py").read_text()
    assert '"data/*.json"' in setup
    assert TABLE_FILE.relative_to(ROOT / "torchrl_oni").as_posix() == "data/balrog_progression.json"
