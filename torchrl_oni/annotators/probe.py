"""Is the judge any good? A calibration probe of captions whose answers are known.

A served model with the wrong prompt can approve nearly everything: measured with the Qwen 0.5B
model behind a URL and the tagged prompt, 93 % of the captions it labelled were "progress" — the
empty message and "Never mind." included — and 60 % of the steps were paid, a survival bonus
instead of ONI, without a word. Before a run's first label the judge answers a dozen captions
whose answers no goal disputes; the run logs how it did and warns loudly when it approves most
captions that show no progress, or cannot tell progress from its absence.

==================  ===========================================================================
captions            known answer
==================  ===========================================================================
``NOT_PROGRESS``    no progress under any goal: the empty message, prompts and refusals
                    ("Never mind.", "In what direction?"), walls, a missed attack
``PROGRESS[goal]``  progress under that ``--goal`` (kills and experience for ``combat``, gold for
                    ``gold``, doors and stairs for ``stairs``; a mix for ``default``)
==================  ===========================================================================

The verdict (:meth:`JudgeReport.problem`): the judge approves at least half of the captions that
show no progress, or approves progress captions less than 0.3 more often than the others (this
also catches a judge that approves nothing); most probe captions unanswered is reported too.

Example:
    >>> import asyncio
    >>> from torchrl_oni.annotators import ScriptedAnnotator
    >>> report = asyncio.run(probe_judge(ScriptedAnnotator()))
    >>> report.problem() is None, report.false_positive_rate, report.true_positive_rate
    (True, 0.0, 1.0)
    >>> class YesMan(ScriptedAnnotator):
    ...     async def annotate(self, captions):
    ...         return [Label(1.0, self.provenance) for _ in captions]
    >>> print(asyncio.run(probe_judge(YesMan())).problem())  # doctest: +ELLIPSIS
    the judge approves 8 of 8 captions that show no progress (e.g. '' (the empty message), 'Never mind.'...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .base import Label

__all__ = ["NOT_PROGRESS", "PROGRESS", "JudgeReport", "probe_judge", "FALSE_POSITIVE_ALARM", "SEPARATION_ALARM"]

NOT_PROGRESS = ("", "Never mind.", "It's solid stone.", "Unknown command '^M'.", "Really attack the kitten?",
                "It's a wall.", "In what direction?", "You miss the newt.")
_DEFAULT = ("You kill the newt!", "Welcome to experience level 2.", "You find a hidden door.",
            "There is a staircase down here.", "$ - 12 gold pieces.")
PROGRESS: Dict[str, Sequence[str]] = {
    "default": _DEFAULT,
    "zero-knowledge": _DEFAULT,
    "combat": ("You kill the newt!", "Welcome to experience level 2.", "You kill the jackal!"),
    "gold": ("You see here 5 gold pieces.", "$ - 12 gold pieces."),
    "stairs": ("You find a hidden door.", "You find a hidden passage.", "There is a staircase down here."),
}
FALSE_POSITIVE_ALARM = 0.5  # approving half of the non-progress captions: a survival bonus, not ONI
SEPARATION_ALARM = 0.3  # approval rate on progress minus on non-progress below this: no signal
ADVICE = ("try another prompt (--llm-prompt short: a yes/no answer scored by its logprobs), a larger model, or "
          "check which model the server serves")


@dataclass
class JudgeReport:
    """What the judge answered on the probe captions."""

    answers: Dict[str, Optional[float]] = field(default_factory=dict)  # caption → label (None: failed)
    expected: Dict[str, float] = field(default_factory=dict)

    def _rate(self, truth: float) -> float:
        got = [self.answers[c] for c, e in self.expected.items() if e == truth and self.answers.get(c) is not None]
        return sum(v > 0.5 for v in got) / len(got) if got else float("nan")

    @property
    def false_positive_rate(self) -> float:
        """Share of the non-progress captions the judge approved."""
        return self._rate(0.0)

    @property
    def true_positive_rate(self) -> float:
        """Share of the progress captions the judge approved."""
        return self._rate(1.0)

    @property
    def answered(self) -> int:
        return sum(v is not None for v in self.answers.values())

    @property
    def accuracy(self) -> float:
        right = [(self.answers[c] > 0.5) == (e > 0.5) for c, e in self.expected.items() if self.answers.get(c) is not None]
        return sum(right) / len(right) if right else float("nan")

    def wrong(self) -> List[str]:
        """The probe captions the judge got wrong, as they would be quoted."""
        return [_quote(c) for c, e in self.expected.items()
                if self.answers.get(c) is not None and (self.answers[c] > 0.5) != (e > 0.5)]

    def problem(self) -> Optional[str]:
        """One sentence when the judge's labels would not make an ONI reward, else None."""
        total = len(self.expected)
        if self.answered < total / 2:
            return f"the judge answered only {self.answered} of {total} probe captions; {ADVICE}"
        fpr, tpr = self.false_positive_rate, self.true_positive_rate
        negatives = [c for c, e in self.expected.items() if e == 0.0 and self.answers.get(c) is not None]
        if fpr >= FALSE_POSITIVE_ALARM:
            approved = [_quote(c) for c in negatives if self.answers[c] > 0.5]
            return (f"the judge approves {len(approved)} of {len(negatives)} captions that show no progress "
                    f"(e.g. {', '.join(approved[:3])}): its labels would pay most steps, a survival bonus instead "
                    f"of ONI; {ADVICE}")
        if tpr - fpr < SEPARATION_ALARM:
            return (f"the judge cannot tell progress from its absence (approves {tpr:.0%} of progress captions, "
                    f"{fpr:.0%} of the others); {ADVICE}")
        return None

    def summary(self) -> str:
        """The line a run logs: how the judge did on the probe."""
        return (f"judge probe: {self.answered} of {len(self.expected)} answered, accuracy {self.accuracy:.0%}, "
                f"approves {self.true_positive_rate:.0%} of progress and {self.false_positive_rate:.0%} of "
                f"non-progress captions" + (f"; wrong on {', '.join(self.wrong()[:4])}" if self.wrong() else ""))

    def metrics(self) -> Dict[str, float]:
        return {"judge/probe_accuracy": self.accuracy, "judge/probe_true_positive_rate": self.true_positive_rate,
                "judge/probe_false_positive_rate": self.false_positive_rate}


def _quote(caption: str) -> str:
    return "'' (the empty message)" if caption == "" else repr(caption)


async def probe_judge(annotator, goal: str = "default") -> JudgeReport:
    """Asks ``annotator`` (any :class:`~torchrl_oni.annotators.base.Annotator`) for the probe
    captions of ``goal`` in one call and returns what it answered."""
    expected = {c: 1.0 for c in PROGRESS.get(goal, _DEFAULT)}
    expected.update({c: 0.0 for c in NOT_PROGRESS})
    captions = list(expected)
    labels: List[Label] = await annotator.annotate(captions)
    answers = {c: (lab.value if lab.ok else None) for c, lab in zip(captions, labels)}
    return JudgeReport(answers=answers, expected=expected)
