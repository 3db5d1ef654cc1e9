"""A simulated, imperfect teacher: the rules annotator with B-Pref-style noise.

:class:`SimulatedTeacher` answers like a person (or a weak LLM) who knows the rules of
:class:`~torchrl_oni.annotators.scripted.ScriptedAnnotator` but is not perfectly reliable. It
stands in for a labeller in label-efficiency experiments and tests, where the answer key (the
noiseless rules) is known. The noise model follows B-Pref (Lee et al., 2021), made for single
captions as well as pairs:

* **rationality** ``beta``: answers are drawn from a logistic choice on the rules' scores —
  a caption is "progress" with probability ``sigmoid(beta · (s − boundary))``, the second of a
  pair is preferred with probability ``sigmoid(beta · (s₂ − s₁))`` (Bradley–Terry).
  ``beta=inf`` (default) is the deterministic rules answer; small ``beta`` is a coin flip;
* **mistake rate** ``epsilon``: after choosing, the answer is flipped with probability ε;
* **skip threshold**: a pair whose two captions both score below it in magnitude (both
  irrelevant) is skipped; a single caption is skipped when its own |score| is below it.
  ``None`` (default) never skips. A skip is a failed label with ``error="skip"``;
* **equal threshold**: a pair whose scores differ by at most this much is a tie (0.5). The
  default 0 ties exactly equal scores, as the rules annotator does.

(B-Pref's myopia γ weighs a segment's later steps more; a caption is one step, so it has none.)

Randomness comes from one seeded :class:`numpy.random.Generator`: the same calls in the same
order give the same answers. The teacher speaks the annotator protocol (async ``annotate``,
``compare``, ``aclose``), so it goes wherever an annotator does, e.g. in an
:class:`~torchrl_oni.annotation.AnnotationWorker`.

Example:
    >>> import asyncio
    >>> from torchrl_oni.annotators.teacher import SimulatedTeacher
    >>> perfect = SimulatedTeacher()
    >>> [l.value for l in asyncio.run(perfect.annotate(["You kill the newt!", "It's a wall."]))]
    [1.0, 0.0]
    >>> always_wrong = SimulatedTeacher(epsilon=1.0)
    >>> always_wrong.label("You kill the newt!"), always_wrong.preference("It's a wall.", "You kill the newt!")
    (0.0, 0.0)
    >>> SimulatedTeacher(skip_threshold=0.5).preference("It's a wall.", "Never mind.") is None
    True
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from torchrl_oni.annotators.base import FIRST, SECOND, SKIP_ERROR, TIE, AnnotatorStats, Label, Preference, Provenance
from torchrl_oni.annotators.scripted import ScriptedAnnotator

__all__ = ["SimulatedTeacher"]


def _sigmoid(x: float) -> float:
    # numerically safe for |x| large (beta can be large)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


class SimulatedTeacher:
    """The rules annotator with B-Pref noise: rationality, mistakes, skips and ties.

    Args:
        goal (str): the rules' goal (``"default"``, ``"combat"``, ``"gold"``, ``"stairs"``...).
        beta (float): rationality; ``math.inf`` (default) answers the rules deterministically.
        epsilon (float): probability of flipping a decided answer (ties are not flipped).
        skip_threshold (float, optional): skip items whose rule scores are all below it in
            magnitude; ``None`` never skips.
        equal_threshold (float): pairs whose scores differ by at most this are ties.
        boundary (float): the score at which a single caption is a coin flip under finite
            ``beta`` (the rules call a caption progress when its score is > 0, and scores are
            whole numbers, so 0.5 sits between "irrelevant" and "progress").
        rules (ScriptedAnnotator, optional): the answer key (``ScriptedAnnotator(goal)`` by
            default).
        seed (int): seed of the noise.

    Example:
        >>> t = SimulatedTeacher(beta=1.0, seed=0)
        >>> round(t.progress_probability("You kill the newt!"), 3)   # rules score 2
        0.818
        >>> t.provenance.annotator
        'teacher'
    """

    def __init__(
        self,
        goal: str = "default",
        *,
        beta: float = math.inf,
        epsilon: float = 0.0,
        skip_threshold: Optional[float] = None,
        equal_threshold: float = 0.0,
        boundary: float = 0.5,
        rules: Optional[ScriptedAnnotator] = None,
        seed: int = 0,
    ):
        if not beta > 0:
            raise ValueError(f"beta must be > 0 (math.inf for a perfectly rational teacher), got {beta}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if skip_threshold is not None and skip_threshold < 0:
            raise ValueError(f"skip_threshold must be >= 0 or None, got {skip_threshold}")
        if equal_threshold < 0:
            raise ValueError(f"equal_threshold must be >= 0, got {equal_threshold}")
        self.rules = rules if rules is not None else ScriptedAnnotator(goal)
        self.beta = float(beta)
        self.epsilon = float(epsilon)
        self.skip_threshold = None if skip_threshold is None else float(skip_threshold)
        self.equal_threshold = float(equal_threshold)
        self.boundary = float(boundary)
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        noise = (f"beta={self.beta:g};eps={self.epsilon:g};skip={self.skip_threshold};"
                 f"equal={self.equal_threshold:g};seed={self.seed}")
        self.provenance = Provenance(annotator="teacher", model=self.rules.provenance.prompt_version,
                                     prompt_version=noise)
        self.stats = AnnotatorStats()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.provenance.model}, {self.provenance.prompt_version})"

    # ------------------------------------------------------------------ one item
    def progress_probability(self, caption: str) -> float:
        """P(the teacher says "progress") before mistakes."""
        score = self.rules.score(caption)
        if math.isinf(self.beta):
            return 1.0 if score > 0 else 0.0
        return _sigmoid(self.beta * (score - self.boundary))

    def second_probability(self, first: str, second: str) -> float:
        """P(the teacher prefers ``second``) for a decided pair, before mistakes (ties: 0.5)."""
        a, b = self.rules.score(first), self.rules.score(second)
        if abs(b - a) <= self.equal_threshold:
            return TIE
        if math.isinf(self.beta):
            return SECOND if b > a else FIRST
        return _sigmoid(self.beta * (b - a))

    def _skips(self, *scores: float) -> bool:
        return self.skip_threshold is not None and max(abs(s) for s in scores) < self.skip_threshold

    def _choose(self, p: float) -> float:
        value = 1.0 if self.rng.random() < p else 0.0
        if self.epsilon and self.rng.random() < self.epsilon:
            value = 1.0 - value
        return value

    def label(self, caption: str) -> Optional[float]:
        """1.0 / 0.0, or ``None`` when the teacher skips the caption."""
        if self._skips(self.rules.score(caption)):
            return None
        return self._choose(self.progress_probability(caption))

    def preference(self, first: str, second: str) -> Optional[float]:
        """P(second is better) as FIRST/SECOND/TIE, or ``None`` when the teacher skips."""
        a, b = self.rules.score(first), self.rules.score(second)
        if self._skips(a, b):
            return None
        p = self.second_probability(first, second)
        if p == TIE:
            return TIE
        return self._choose(p)

    # ------------------------------------------------------------------ annotator protocol
    async def annotate(self, captions: Sequence[str]) -> List[Label]:
        """One :class:`Label` per caption; skipped ones fail with ``error="skip"``."""
        self.stats.requests += 1
        self.stats.captions += len(captions)
        out = []
        for caption in captions:
            value = self.label(caption)
            if value is None:
                self.stats.count_error(SKIP_ERROR)
                out.append(Label(value=None, provenance=self.provenance, error=SKIP_ERROR))
            else:
                self.stats.labelled += 1
                out.append(Label(value=value, provenance=self.provenance))
        return out

    async def compare(self, pairs: Sequence[Tuple[str, str]]) -> List[Preference]:
        """One :class:`Preference` per pair; skipped ones fail with ``error="skip"``."""
        self.stats.requests += 1
        out = []
        for first, second in pairs:
            value = self.preference(first, second)
            if value is None:
                self.stats.count_error(SKIP_ERROR)
                out.append(Preference(value=None, provenance=self.provenance, error=SKIP_ERROR))
            else:
                out.append(Preference(value=value, provenance=self.provenance))
        return out

    async def aclose(self) -> None:
        """Nothing to release."""
