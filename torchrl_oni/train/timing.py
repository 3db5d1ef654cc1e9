"""Where the learner's time goes: wall time per stage of each PPO update.

The trainer wraps each stage of an update in ``with clock("stage"):`` and logs the shares;
``benchmarks/learner_throughput.py`` and ``benchmarks/train_throughput.py`` print them as a table.

=================  ===================================================================
stage              what it covers
=================  ===================================================================
``wait``           the learner waiting for a collected batch (not part of an update)
``gather``         joining several workers' batches into one update (``--frames-per-update``)
``hooks``          batch transforms and hooks: annotation queue, intrinsic reward lookup
``reward``         mixing extrinsic and intrinsic reward into PPO's reward
``transfer``       the batch to the learner's device (pinned, non-blocking on CUDA)
``gae``            values of the batch's observations and the advantages
``minibatch``      cutting minibatches out of the batch
``forward``        the PPO loss's forward pass (actor, critic, entropy)
``backward``       its backward pass
``optimizer``      gradient clipping and the Adam step
``stats``          loss statistics, reduced on the device and read once per update
``weights``        fresh weights to the acting policy (workers or the inference server)
``after_update``   hooks after the update (reward-model training)
``log``            metrics rows, progress bar, episode statistics, checkpoints
=================  ===================================================================

On CUDA, kernels run asynchronously: without ``synchronize=True`` a stage's time is the host's
(launching the kernels), and the wait lands in whichever stage next reads a result from the
device (``stats``). The benchmarks synchronise; the trainer does not (it would slow it down).

Example:
    >>> clock = StageClock()
    >>> with clock("forward"):
    ...     _ = sum(range(1000))
    >>> clock.count("forward"), clock.total("forward") > 0
    (1, True)
    >>> sorted(clock.shares(["forward"]))
    ['forward']
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterable, Optional

import torch

__all__ = ["STAGES", "UPDATE_STAGES", "LOSS_STAGES", "StageClock"]

STAGES = ("wait", "gather", "hooks", "reward", "transfer", "gae", "minibatch", "forward", "backward",
          "optimizer", "stats", "weights", "after_update", "log")
UPDATE_STAGES = STAGES[1:]  # the learner's own work, batch in hand
LOSS_STAGES = ("forward", "backward")  # the PPO loss itself; the rest is overhead around it


class StageClock:
    """Sums wall time per named stage.

    Args:
        synchronize: a CUDA device to synchronise at each stage's end, so that a stage's time
            includes its kernels (benchmarks only: it stalls the pipeline).
    """

    def __init__(self, synchronize: Optional[torch.device] = None):
        self.sync = synchronize if synchronize is not None and synchronize.type == "cuda" else None
        self._total: Dict[str, float] = {}
        self._count: Dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                torch.cuda.synchronize(self.sync)
            self.add(stage, time.perf_counter() - t0)

    def add(self, stage: str, seconds: float) -> None:
        self._total[stage] = self._total.get(stage, 0.0) + seconds
        self._count[stage] = self._count.get(stage, 0) + 1

    def total(self, stage: str) -> float:
        return self._total.get(stage, 0.0)

    def count(self, stage: str) -> int:
        return self._count.get(stage, 0)

    def totals(self) -> Dict[str, float]:
        return dict(self._total)

    def shares(self, stages: Iterable[str] = UPDATE_STAGES) -> Dict[str, float]:
        """Each stage's share of the time summed over ``stages`` (stages never timed left out)."""
        stages = [s for s in stages if s in self._total]
        whole = sum(self._total[s] for s in stages) or 1e-12
        return {s: self._total[s] / whole for s in stages}

    def outside_loss_share(self) -> float:
        """Share of an update spent outside the loss's forward and backward passes."""
        update = sum(self._total.get(s, 0.0) for s in UPDATE_STAGES)
        loss = sum(self._total.get(s, 0.0) for s in LOSS_STAGES)
        return (update - loss) / update if update else 0.0

    def reset(self) -> None:
        self._total.clear()
        self._count.clear()

    def metrics(self, prefix: str = "learner/") -> Dict[str, float]:
        """Shares of the update per stage and the share outside the loss, for the metrics rows."""
        out = {f"{prefix}{stage}_share": share for stage, share in self.shares().items()}
        out[f"{prefix}outside_loss_share"] = self.outside_loss_share()
        return out
