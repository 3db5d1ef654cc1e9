"""Reading labels and preferences out of free-form LLM answers.

The rule everywhere: never guess. ONI read any answer that contained "FOO" as helpful (so an
echoed "FOO/BAR" counted as 1) and any other answer as 0, which silently turns model failures
into training labels. Here an answer is read in three steps:

1. **strict**: the tagged field the prompt asked for (``<label>FOO</label>``, ``<best>2</best>``);
   the last tag holding exactly one answer wins (answers come after any echoed instructions; an
   echoed ``<label>FOO or BAR</label>`` holds two and is skipped);
2. **lenient**: a ``label: FOO`` / ``best_description: 2`` / ``Message 1 is better`` style phrase;
3. **mentions**: the label tokens anywhere in the text — usable only if exactly one of them
   appears. Both or none makes the answer *unparsable*: the functions return ``None`` and the
   caller counts it and asks again later.

Example:
    >>> from torchrl_oni.annotators.parsing import parse_label, parse_preference, parse_yes_no
    >>> parse_label("<knowledge>...</knowledge><analysis>A kill.</analysis><label>FOO</label>")
    1.0
    >>> parse_label("Use FOO or BAR.") is None   # both mentioned: unparsable, not 1
    True
    >>> parse_yes_no(" No.")
    0.0
    >>> parse_preference("<best>2</best>")
    1.0
"""
from __future__ import annotations

import math
import re
from typing import Dict, Optional, Sequence, Tuple

from torchrl_oni.annotators.base import FIRST, SECOND, TIE
from torchrl_oni.annotators.prompts import (
    NEGATIVE_TOKEN,
    POSITIVE_TOKEN,
    SHORT_NEGATIVE,
    SHORT_POSITIVE,
)

# Characters models wrap answers in: markdown emphasis, code ticks, quotes, brackets, punctuation.
_WRAP = " \t\r\n*_`\"'()[]{}.,;:!-=>|#"


def _norm(text: str) -> str:
    return text.strip(_WRAP).lower()


def _word(token: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(token)}(?![A-Za-z0-9])", re.I)


def _tag_contents(text: str, tag: str):
    # An unclosed last tag (answer cut by max_tokens) still counts up to the line end.
    pattern = rf"<\s*{tag}\s*>\s*(.*?)(?:<\s*/\s*{tag}\s*>|\n|$)"
    return re.findall(pattern, text, re.I | re.S)


def _one_of(content: str, options: Dict[str, float]) -> Optional[float]:
    """The value of the only option ``content`` mentions as a word, else ``None``."""
    found = {value for token, value in options.items() if _word(token).search(content)}
    return found.pop() if len(found) == 1 else None


def parse_label(
    text: str, positive: str = POSITIVE_TOKEN, negative: str = NEGATIVE_TOKEN
) -> Optional[float]:
    """1.0 (positive label), 0.0 (negative label) or ``None`` (unparsable).

    Args:
        text: the model's answer.
        positive: the helpful label token (``FOO``).
        negative: the unhelpful label token (``BAR``).
    """
    if not text or not text.strip():
        return None
    options = {positive: 1.0, negative: 0.0}
    # 1. strict: the last <label> tag that names exactly one label.
    for content in reversed(_tag_contents(text, "label")):
        value = _one_of(content, options)
        if value is not None:
            return value
    # 2. lenient: "Label: FOO", "**label** - `bar`", "the label is FOO" (not "<label>").
    # A separator or a verb is required: "the label FOO for ..." is an echoed instruction.
    phrase = re.compile(
        rf"\blabel\b(?!\s*>)[*_`\"' ]*(?:[:=\-]|\s+is\b|\s+would\s+be\b|\s+should\s+be\b)"
        rf"[\s:*_`\"'=\-]*({re.escape(positive)}|{re.escape(negative)})(?![A-Za-z0-9])",
        re.I,
    )
    matches = {m.lower() for m in phrase.findall(text)}
    if len(matches) == 1:
        return options[positive] if matches.pop() == positive.lower() else options[negative]
    # A bare one-word answer, any case ("foo", "**BAR**.").
    bare = _norm(text)
    if bare in (positive.lower(), negative.lower()):
        return 1.0 if bare == positive.lower() else 0.0
    # 3. mentions: the exact tokens as written in the prompt, only if one of them appears.
    pos = re.search(rf"(?<![A-Za-z0-9]){re.escape(positive)}(?![A-Za-z0-9])", text)
    neg = re.search(rf"(?<![A-Za-z0-9]){re.escape(negative)}(?![A-Za-z0-9])", text)
    if bool(pos) != bool(neg):
        return 1.0 if pos else 0.0
    return None


def parse_yes_no(
    text: str, positive: str = SHORT_POSITIVE, negative: str = SHORT_NEGATIVE
) -> Optional[float]:
    """Reads the one-word answer of the short prompt: 1.0 (yes), 0.0 (no) or ``None``.

    The first word decides ("Yes, because ..."); otherwise the answer must mention exactly one of
    the two words.
    """
    if not text or not text.strip():
        return None
    first = _norm(re.split(r"[\s,.;:!]+", text.strip(_WRAP), maxsplit=1)[0])
    if first == positive.lower():
        return 1.0
    if first == negative.lower():
        return 0.0
    return _one_of(text, {positive: 1.0, negative: 0.0})


_PREF_WORDS = {
    "1": FIRST, "2": SECOND, "tie": TIE, "none": TIE, "neither": TIE, "equal": TIE, "both": TIE,
}


def _preference_in_tag(content: str) -> Optional[float]:
    words = re.findall(r"[A-Za-z]+|\d+", content.lower())
    # "message 1" / "description_2" name a position; drop the noun.
    words = [w for w in words if w not in ("message", "description", "msg", "the", "is", "best")]
    found = {_PREF_WORDS[w] for w in words if w in _PREF_WORDS}
    other_numbers = [w for w in words if w.isdigit() and w not in ("1", "2")]
    if len(found) == 1 and not other_numbers:
        return found.pop()
    return None


def parse_preference(text: str) -> Optional[float]:
    """P(second is better) from a ranking answer: 0.0, 1.0, 0.5 (tie) or ``None`` (unparsable)."""
    if not text or not text.strip():
        return None
    # 1. strict: the last <best> tag naming exactly one answer.
    for content in reversed(_tag_contents(text, "best")):
        value = _preference_in_tag(content)
        if value is not None:
            return value
    # 2. lenient: ("best_description": 2), best message: 1, best = tie.
    phrase = re.compile(
        r"\bbest[\s_]*(?:description|message)?(?!\s*>)[\s\"':=*_`\-]*(?:is\s+)?"
        r"(?:message|description)?[\s_#]*(1|2|tie|none|neither)(?![A-Za-z0-9])",
        re.I,
    )
    matches = phrase.findall(text)
    if matches:
        return _PREF_WORDS[matches[-1].lower()]
    # "Message 2 is better" / "description 1 is more likely".
    claim = re.findall(
        r"\b(?:message|description)[\s_#]*(1|2)\b[\"'*`]*\s+is\s+(?:better|more|the\s+best)",
        text,
        re.I,
    )
    if len(set(claim)) == 1:
        return _PREF_WORDS[claim[0]]
    bare = _norm(text)
    if bare in _PREF_WORDS:
        return _PREF_WORDS[bare]
    return None


def _token_matches(token: str, label: str, other: str) -> bool:
    norm, label, other = _norm(token), label.lower(), other.lower()
    if not norm:
        return False
    if norm == label:
        return True
    # A tokenizer may split "FOO" into "FO" + "O": accept an unambiguous prefix.
    return len(norm) >= 2 and label.startswith(norm) and not other.startswith(norm)


def score_from_top_logprobs(
    positions: Sequence[Tuple[str, Dict[str, float]]],
    positive: str,
    negative: str,
) -> Optional[float]:
    """P(positive) / (P(positive) + P(negative)) at the answer's label position.

    Args:
        positions: per generated token, ``(sampled_token, {candidate_token: logprob})``.
        positive, negative: the two label tokens.

    The label position is the last one whose sampled token is a label; failing that, the first
    whose candidates include a label. A label missing from the candidates is given the smaller of
    the least listed probability and the mass left over (it ranked below all listed ones).
    Returns ``None`` when no position mentions either label.

    Example:
        >>> round(score_from_top_logprobs([(" yes", {" yes": -0.2, " no": -1.8})], "yes", "no"), 3)
        0.832
    """
    def is_label(token: str) -> bool:
        return (_token_matches(token, positive, negative)
                or _token_matches(token, negative, positive))

    chosen = None
    for sampled, top in reversed(list(positions)):
        if is_label(sampled):
            chosen = top
            break
    if chosen is None:
        for _, top in positions:
            if any(is_label(t) for t in top):
                chosen = top
                break
    if not chosen:
        return None
    p_pos = sum(math.exp(lp) for t, lp in chosen.items() if _token_matches(t, positive, negative))
    p_neg = sum(math.exp(lp) for t, lp in chosen.items() if _token_matches(t, negative, positive))
    if p_pos == 0.0 and p_neg == 0.0:
        return None
    listed = [math.exp(lp) for lp in chosen.values()]
    missing = max(0.0, min(min(listed), 1.0 - sum(listed)))
    p_pos = p_pos or missing
    p_neg = p_neg or missing
    return p_pos / (p_pos + p_neg)
