"""Reward-hacking diagnostics: paid captions that come just before deaths, who earns the
intrinsic return, and payments that repeat.

An intrinsic reward written by an LLM can be hacked: on ``staircase`` the agents learned to eat
until they choked (rules labels: 118 of 171 deaths), which a person found by reading death
causes. This module finds it from what every run has: per episode, the captions the agent acted
on, the intrinsic reward each of those steps paid, and how the episode ended. ``oni-eval``
(:mod:`torchrl_oni.evaluate`) and ``oni-train``'s final summary
(:mod:`torchrl_oni.train.intrinsic`) report it; ``oni-label`` puts the flagged captions first
(:func:`read_flagged`).

Input, one :meth:`HackingTally.add_episode` call per finished episode (non-empty captions only;
:class:`EpisodeAssembler` cuts collected ``[R, T]`` batches into these):

===========  ===========  ==================================================================
argument     dtype/shape  meaning
===========  ===========  ==================================================================
``hashes``   int64[n]     caption hash of each step with a non-empty message (the caption the
                          reward is paid for: by default the observation acted on)
``paid``     float[n]     the intrinsic reward that step paid (0: unpaid)
``steps``    int[n]       the step's index in the episode, ``0 .. length - 1``, increasing
``length``   int          steps in the episode
``died``     bool         the episode ended in the agent's death (not a time-out or success)
===========  ===========  ==================================================================

What :meth:`HackingTally.report` returns (JSON-ready; caption hashes are strings, as on the
labelling page: an int64 does not fit a JavaScript number):

=====================  ==========================================================================
key                    meaning
=====================  ==========================================================================
``window``             N: a step *comes before a death* when its episode ended in death at most
                       N steps later (``length - step <= N``)
``episodes``,          episodes, deaths, steps counted; ``intrinsic_return``: the sum of all
``deaths``, ``steps``  payments; ``paid_captions`` / ``captions``: distinct captions paid / seen
``baseline``           ``{of, sightings, before_death, rate}``: how often the sightings of
                       *unpaid* captions come before a death (all steps when unpaid captions were
                       seen fewer than :data:`MIN_BASELINE` times); ``chance_rate``: the share
                       of all steps that come before a death
``top``                the paid captions with the largest share of the intrinsic return (rows)
``flagged``            the paid captions that come before deaths far above chance (the verdict,
                       strongest first): the ``!!`` line names them
``loops``              ``reset``: paid again after every reset (in at least half of the
                       episodes, first paid in the first quarter of each on average);
                       ``episode``: paid many times within one episode (over half of its return
                       from repeats, 3+ payments per paying episode)
``rule``               the thresholds used; ``warnings``: the lines a user must see
=====================  ==========================================================================

A row: ``hash``, ``message``, ``return_share`` (of the intrinsic return), ``paid``, ``payments``
(steps that paid), ``sightings``, ``before_death`` (sightings that came before a death),
``rate`` (``before_death / sightings``), ``ratio`` and ``ratio_ci95`` (``rate`` over the
baseline's, Katz's 95 % interval: :func:`torchrl_oni.stats.rate_ratio_ci`), ``deaths_preceded``
and ``death_share`` (deaths it came before, of all deaths), ``episode_share`` (episodes that paid
it), ``first_paid_at`` (mean position of its first payment, as a fraction of the episode),
``payments_per_episode`` (in episodes that paid it), ``max_payments`` (in one episode),
``repeat_share`` (of its return, paid after its first payment in an episode).

**The verdict.** A paid caption is flagged when the lower end of its ratio's 95 % interval is at
least :data:`MIN_RATIO` (3) and it came before at least :data:`MIN_DEATH_SHARE` (a tenth) of the
deaths, and at least :data:`MIN_DEATHS` of them. Why these: danger itself is not hacking. A
reward for kills pays "You kill the jackal!" in the fights where agents also die, so any paid
caption of a dangerous activity comes before deaths somewhat more often than average; but the
unpaid captions of the same fights ("The jackal bites!") do too, which is why the baseline is the
unpaid captions and the bar three times their rate with 95 % confidence rather than any excess.
And a caption that came before one death in a hundred cannot be what kills the agents, hence the
tenth of the deaths. The sightings of one caption within one episode are not independent (ten
sightings before one death count ten), so the interval is narrower than it should be for
captions that repeat; counting distinct deaths guards against one episode's repeats.

**How the agents die** (:func:`death_causes_check`, ``eval.json``'s ``death_causes_check``). A
reward can teach a deadly habit through captions paid long before the death, which the window
rule cannot see (staircase, rules labels: choking after paid meals, the captions just before it
unpaid). With ``oni-eval --baseline OTHER`` (an evaluation of the same task, e.g. the
extrinsic-only arm) each death cause's share of the episodes is compared with the baseline's
(Katz rate ratio, one-sided Fisher p) and a cause at least :data:`MIN_CAUSE_RATIO` times the
baseline's with 95 % confidence is flagged; without one, a cause the agent brings on itself
(:data:`SELF_INFLICTED`) that ends more than half of the episodes is. Under each cause, the paid
captions whose episodes end in it more often than the episodes that did not pay them; ``oni-label``
puts those of a flagged cause first.

Example (a paid caption that comes right before every death; another paid at every step):
    >>> import numpy as np
    >>> from torchrl_oni.reward_hacking import HackingTally
    >>> tally = HackingTally(window=20)
    >>> EAT, WALK = 1, 2
    >>> for _ in range(10):
    ...     steps = np.arange(0, 100, 5)                 # a non-empty message every 5th step
    ...     hashes = np.full(len(steps), WALK); hashes[-1] = EAT
    ...     paid = np.where(hashes == EAT, 1.0, 0.0); paid[0] = 0.5   # WALK paid once per episode
    ...     tally.add_episode(hashes, paid, steps, length=100, died=True)
    >>> report = tally.report({EAT: "You finish eating the food ration.", WALK: "You see here a rock."})
    >>> [row["message"] for row in report["flagged"]]
    ['You finish eating the food ration.']
    >>> report["flagged"][0]["deaths_preceded"], report["deaths"]
    (10, 10)
    >>> print(report["warnings"][0][:73])
    paid captions come before deaths far above chance: "You finish eating the
"""
from __future__ import annotations

from .death_causes import (CAPTIONS_PER_CAUSE, CAUSE_HINTS, DOMINANT_SHARE, MIN_CAUSE_DEATHS, MIN_CAUSE_RATIO,
                           MIN_CAUSE_SHARE, MIN_ENRICHMENT, SELF_INFLICTED, death_causes_check, format_death_causes,
                           read_baseline)
from .flagged import read_flagged
from .tally import (APPROVED_WINDOW, DEATH_WINDOW, EMPTY_HASH, LOOP_WARNING_SHARE, MIN_APPROVED_WINDOW, MIN_BASELINE,
                    MIN_DEATH_SHARE, MIN_DEATHS, MIN_RATIO, REPEAT_PAYMENTS, REPEAT_SHARE, REPORT_NAME, RESET_EARLY,
                    RESET_EPISODE_SHARE, TOP, EpisodeAssembler, HackingTally, format_report)

__all__ = ["HackingTally", "EpisodeAssembler", "format_report", "read_flagged", "DEATH_WINDOW", "MIN_RATIO",
           "MIN_DEATH_SHARE", "MIN_DEATHS", "REPORT_NAME", "death_causes_check", "format_death_causes", "read_baseline",
           "SELF_INFLICTED", "MIN_CAUSE_RATIO"]
