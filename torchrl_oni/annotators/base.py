"""The annotator protocol: what every source of LLM judgements provides.

An annotator turns caption texts into labels (is this message progress?) and caption pairs into
preferences (which of the two is more progress?). Calls are ``async`` so one event loop can
keep many requests in flight; every result carries its provenance, or says why it failed.
Annotators never import TorchRL: they see strings, not TensorDicts.

Example:
    >>> import asyncio
    >>> from torchrl_oni.annotators.base import Label, Provenance
    >>> prov = Provenance(annotator="scripted", model="rules-v1", prompt_version="none")
    >>> Label(value=1.0, provenance=prov).ok
    True
    >>> Label(value=None, provenance=prov, error="unparsable").ok
    False
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence, Tuple, runtime_checkable

# Preference codes, as in Motif/ONI: the first is better, the second is better, a tie.
FIRST = 0.0
SECOND = 1.0
TIE = 0.5

# The error kind of a labeller's refusal to answer (a person, a simulated teacher): a final answer
# that labelling queues never ask again (torchrl_oni.store.is_skip).
SKIP_ERROR = "skip"


@dataclass(frozen=True)
class Provenance:
    """Who produced a judgement: annotator kind, model name and prompt version."""

    annotator: str
    model: str = ""
    prompt_version: str = ""


@dataclass
class Label:
    """One caption's judgement.

    Attributes:
        value: 1.0 (helpful / progress), 0.0 (not), or ``None`` when the annotation failed.
        score: the annotator's probability that the caption is helpful, when it has one
            (e.g. from the label token's logprob); ``None`` otherwise.
        provenance: who produced it.
        error: why it failed (``"unparsable"``, ``"http 500"``, ``"timeout"``...), else ``None``.
        raw: the model's raw answer, kept for inspection.
    """

    value: Optional[float]
    provenance: Provenance
    score: Optional[float] = None
    error: Optional[str] = None
    raw: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and self.error is None


@dataclass
class Preference:
    """One pair's judgement: ``value`` is P(second is better): 0.0, 1.0, 0.5 (tie) or ``None``."""

    value: Optional[float]
    provenance: Provenance
    error: Optional[str] = None
    raw: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and self.error is None


@runtime_checkable
class Annotator(Protocol):
    """What the annotation worker needs from an annotator."""

    provenance: Provenance

    async def annotate(self, captions: Sequence[str]) -> List[Label]:
        """One :class:`Label` per caption, in order (failures included, never dropped)."""
        ...

    async def compare(self, pairs: Sequence[Tuple[str, str]]) -> List[Preference]:
        """One :class:`Preference` per pair, in order (failures included, never dropped)."""
        ...

    async def aclose(self) -> None:
        """Releases sessions/connections. Safe to call twice."""
        ...


@dataclass
class AnnotatorStats:
    """Counters an annotator keeps for the metrics (labels/s, failures, latency)."""

    requests: int = 0
    captions: int = 0
    labelled: int = 0
    unparsable: int = 0
    server_errors: int = 0
    timeouts: int = 0
    latency_s_total: float = 0.0
    errors_by_kind: dict = field(default_factory=dict)

    def count_error(self, kind: str, n: int = 1) -> None:
        self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + n
