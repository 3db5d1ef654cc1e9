"""Human feedback: a labelling page for captions and caption pairs, beside (never blocking) training.

* :func:`serve_feedback` / :class:`FeedbackServer` (:mod:`~torchrl_oni.feedback.server`): an
  aiohttp app in its own thread over a live :class:`~torchrl_oni.store.CaptionStore`; people's
  answers land in the store with provenance ``human``.
* ``oni-label --store PATH`` (:mod:`~torchrl_oni.feedback.cli`): the same page over a saved store,
  saved back atomically as people answer and at exit.
* :class:`ScreenSnapshots` (:mod:`~torchrl_oni.feedback.screens`): the game screens shown beside
  captions (a bounded side table, saved apart from the store).

The page itself is ``static/`` (plain HTML, CSS and JavaScript: no build step, nothing loaded
from elsewhere).

Example:
    >>> from torchrl_oni.feedback import FeedbackServer, ScreenSnapshots, serve_feedback
    >>> FeedbackServer.__name__, ScreenSnapshots(capacity=8).capacity
    ('FeedbackServer', 8)
"""
from torchrl_oni.feedback.screens import ScreenSnapshots
from torchrl_oni.feedback.server import HUMAN, FeedbackServer, serve_feedback

__all__ = ["FeedbackServer", "ScreenSnapshots", "serve_feedback", "HUMAN"]
