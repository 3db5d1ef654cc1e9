"""Labels made before the run, and no new ones: the annotator behind ``--annotator store``.

A run can start from the labels of earlier runs (``--labels-from STORE [STORE ...]``: their
caption stores, copied into this run's store by :meth:`~torchrl_oni.store.CaptionStore.import_labels`
when it opens). With ``--annotator store`` those are its only labels: :class:`NoNewLabels` answers
every caption the run sees that they do not cover with a *skip*, the labeller's final "no answer"
(:data:`~torchrl_oni.annotators.base.SKIP_ERROR`). A skipped caption is never asked again, has no
label, and so pays what an unlabelled caption pays (ONI-Retrieval: nothing); the run counts it in
``labels/skipped`` and its steps are missing from ``labels/seen_coverage``.

Why: an LLM's labels can be made where the LLM runs and the training can go where the GPU is. On
the GPU machine, which no LLM server can reach and whose inputs are limited to 64 MiB, the runs of
the sparse-task experiment use the labels the embedded model gave on the CPU box (a store of a
few MB). A classification reward model trained on such labels still generalises to captions they
do not cover; a retrieval reward pays only for what they cover.

Example:
    >>> import asyncio
    >>> from torchrl_oni.annotators.stored import NoNewLabels
    >>> labels = asyncio.run(NoNewLabels().annotate(["You find a hidden passage."]))
    >>> labels[0].ok, labels[0].error
    (False, 'skip')
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from torchrl_oni.annotators.base import SKIP_ERROR, AnnotatorStats, Label, Preference, Provenance

__all__ = ["NoNewLabels"]


class NoNewLabels:
    """An annotator that declines everything it is asked: the run keeps the labels it started with."""

    def __init__(self):
        self.provenance = Provenance(annotator="store", model="", prompt_version="none")
        self.stats = AnnotatorStats()

    async def annotate(self, captions: Sequence[str]) -> List[Label]:
        """A skip for every caption (one per caption, in order)."""
        self.stats.requests += 1
        self.stats.captions += len(captions)
        if captions:
            self.stats.count_error(SKIP_ERROR, len(captions))
        return [Label(value=None, provenance=self.provenance, error=SKIP_ERROR) for _ in captions]

    async def compare(self, pairs: Sequence[Tuple[str, str]]) -> List[Preference]:
        """A skip for every pair (a run on stored labels makes no preferences either)."""
        self.stats.requests += 1
        return [Preference(value=None, provenance=self.provenance, error=SKIP_ERROR) for _ in pairs]

    async def aclose(self) -> None:
        """Nothing to release."""
