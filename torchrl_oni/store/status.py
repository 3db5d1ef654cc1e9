"""The statuses of an item in a labelling queue: one numbering for every queue of the package.

:class:`~torchrl_oni.store.CaptionStore`'s captions and pairs,
:class:`~torchrl_oni.rewards.ellm.GoalTable`'s states and Motif's pair annotations
(:func:`~torchrl_oni.rewards.motif.annotate_pairs`) all keep their status in an ``int8`` column
that is saved to disk, so these numbers are a file format and never change:

==========  =====  ==================================================================
status      value  meaning
==========  =====  ==================================================================
UNSEEN      0      waiting to be handed out (again, after a failure and its backoff)
PENDING     1      handed out, no answer yet (saved as unseen: pending is not finished)
LABELLED    2      answered (ELLM's goal table calls it *done*)
FAILED      3      caption store: left by versions that gave items up after server
                   faults, put back in the queue by ``requeue_server_failures``;
                   goal table: given up after ``max_attempts`` unparsable answers
GIVEN_UP    4      given up after ``max_attempts`` unparsable answers
SKIPPED     5      the labeller declined the item: a final answer, never asked again
                   (Motif: a pair of identical captions, tied without asking)
==========  =====  ==================================================================

Example:
    >>> from torchrl_oni.store.status import LABELLED, Status
    >>> Status(2) is LABELLED, int(Status.SKIPPED), STATUS_NAMES[Status.GIVEN_UP]
    (True, 5, 'given up')
"""
from __future__ import annotations

from enum import IntEnum

__all__ = ["Status", "UNSEEN", "PENDING", "LABELLED", "FAILED", "GIVEN_UP", "SKIPPED", "STATUS_NAMES"]


class Status(IntEnum):
    """Where an item is in its labelling queue (the values are saved: see the module docstring)."""

    UNSEEN = 0
    PENDING = 1
    LABELLED = 2
    FAILED = 3
    GIVEN_UP = 4
    SKIPPED = 5


UNSEEN, PENDING, LABELLED, FAILED, GIVEN_UP, SKIPPED = Status

STATUS_NAMES = {UNSEEN: "unseen", PENDING: "pending", LABELLED: "labelled", FAILED: "failed",
                GIVEN_UP: "given up", SKIPPED: "skipped"}
