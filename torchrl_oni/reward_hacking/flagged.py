"""``oni-label``'s reader: :func:`read_flagged` reads the captions to put first on the labelling
page from what ``oni-eval`` (``eval.json``) or ``oni-train`` (``reward_hacking.json``) wrote, or from
a list chosen by hand.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

from ..captions import encode_message, hash_bytes, message_bytes
from .tally import _num, _times

__all__ = ["read_flagged"]


def read_flagged(path) -> List[Tuple[int, str]]:
    """``[(caption hash, why)]`` to put first on the labelling page, from a JSON file: an
    ``eval.json`` of ``oni-eval`` or a ``reward_hacking.json`` of ``oni-train`` (their flagged
    captions, strongest first), or a JSON list of captions (texts) chosen by hand.

    Raises:
        ValueError: a file that is none of these, in one sentence.
        OSError: a file that cannot be read.

    Example:
        >>> import json, tempfile
        >>> path = tempfile.mktemp(suffix=".json")
        >>> _ = open(path, "w").write(json.dumps(["You choke over your food."]))
        >>> [why.startswith("listed in ") for _, why in read_flagged(path)]
        [True]
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{path} is not a JSON file (an oni-eval eval.json, a reward_hacking.json or a list of "
                         "captions)") from None
    if isinstance(data, list):
        if not all(isinstance(x, str) for x in data):
            raise ValueError(f"{path}: a list of captions must hold strings only")
        return [(hash_bytes(message_bytes(encode_message(x))), f"listed in {path.name}") for x in data]
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an oni-eval eval.json, a "
                         "reward_hacking.json or a list of captions")
    report = data.get("reward_hacking", data)
    check = data.get("death_causes_check")
    causes = _cause_flagged(path, check) if check is not None else []
    if not isinstance(report, dict) or "flagged" not in report:
        if isinstance(check, dict):
            return causes
        raise ValueError(f"{path} holds no reward-hacking diagnostics (an eval.json of an older oni-eval, or "
                         "of a run that paid no intrinsic reward?)")
    rows = report["flagged"]
    window = report.get("window")
    deaths = report.get("deaths")
    base = report.get("baseline")
    base = base.get("of") if isinstance(base, dict) and isinstance(base.get("of"), str) else "unpaid captions"
    if not isinstance(rows, list):
        raise ValueError(f"{path}: 'flagged' is not a list")
    out = []
    for r in rows:
        try:
            h = _int64(r["hash"])
            why = (f"flagged: before {int(r['deaths_preceded'])} of {int(deaths)} deaths within {int(window)} "
                   f"steps, {_times(_num(r['ratio']) if r.get('ratio') is not None else None)}x the rate of {base[:40]}")
        except (TypeError, KeyError, ValueError, OverflowError):
            raise ValueError(f"{path}: a flagged caption without a valid hash and counts") from None
        out.append((h, why))
    seen = {h for h, _ in out}
    return out + [(h, why) for h, why in causes if h not in seen]


def _cause_flagged(path: Path, check) -> List[Tuple[int, str]]:
    """``read_flagged``'s rows for the captions listed under the flagged causes of a ``death_causes_check``."""
    if not isinstance(check, dict) or not isinstance(check.get("by_cause"), list):
        raise ValueError(f"{path}: 'death_causes_check' is not a death-cause check")
    out, seen = [], set()
    for row in check["by_cause"]:
        if not isinstance(row, dict) or not row.get("flagged"):
            continue
        for r in row.get("captions") or []:
            try:
                h = _int64(r["hash"])
                why = (f"linked to {str(row['cause'])[:30]} (flagged): {int(r['ending'])} of the {int(r['episodes_paid'])} "
                       f"episodes that paid it end in it")
            except (TypeError, KeyError, ValueError, OverflowError):
                raise ValueError(f"{path}: a caption under a flagged death cause without a valid hash and counts") from None
            if h not in seen:
                seen.add(h)
                out.append((h, why))
    return out


def _int64(value) -> int:
    """A caption hash read from a file: an int in int64's range, else ``ValueError``."""
    h = int(value)
    if not -2 ** 63 <= h < 2 ** 63:
        raise ValueError(f"{h} is outside int64")
    return h
