"""Trainer hooks and the stages of the training loop they declare.

A hook says where it runs, as TorchRL's ``TrainerHookBase.register`` / ``Trainer.register_op``
do: its ``stages`` name the stages it implements, :meth:`TrainHook.register` hands them to the
trainer, and the trainer builds one list of hooks per stage when it is built. The loop then
calls those lists: a hook is never asked what it has, and a stage no hook declared costs nothing.

==================  =============================================  ==========================================
stage               what the trainer calls                         when
==================  =============================================  ==========================================
``batch``           ``on_batch(batch, trainer) -> batch``          each update's batch (the workers' batches
                                                                   gathered for it), before the reward is
                                                                   combined: annotation, reward lookup
``post_update``     ``after_update(trainer)``                      after each PPO iteration (reward models)
``metrics``         ``metrics() -> dict``                          each metrics row, and the run's last
``alert``           ``alert(metrics) -> str or None``              after each row: lines above the progress bar
``bar``             ``bar_fields(metrics) -> list of str``         the progress bar's words
``summary``         ``summary_lines(metrics) -> list of str``      the run's summary, plain lines
``final_warnings``  ``final_warnings(metrics) -> list of str``     the run's summary, ``!!`` lines
``state``           ``state_dict()`` / ``load_state_dict(state)``  each checkpoint / ``--resume``
``close``           ``close(save=True)``                           the end of training; ``save=False``: a run
                                                                   that never started writes nothing
==================  =============================================  ==========================================

Every list keeps the order of the hooks given to the trainer.

Example:
    >>> class CountBatches(TrainHook):
    ...     name = "count"
    ...     stages = ("batch", "metrics")
    ...     def __init__(self):
    ...         self.batches = 0
    ...     def on_batch(self, batch, trainer):
    ...         self.batches += 1
    ...         return batch
    ...     def metrics(self):
    ...         return {"count/batches": self.batches}
    >>> class Registry:  # what the trainer does with a hook, in miniature
    ...     def __init__(self):
    ...         self.at = {stage: [] for stage in STAGES}
    ...     def register_op(self, stage, hook):
    ...         self.at[stage].append(hook)
    >>> trainer = Registry()
    >>> CountBatches().register(trainer)
    >>> {stage: len(hooks) for stage, hooks in trainer.at.items() if hooks}
    {'batch': 1, 'metrics': 1}
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

__all__ = ["TrainHook", "STAGES"]

# stage -> the method the trainer calls there ("state": state_dict at checkpoints, load_state_dict on --resume)
STAGES: Dict[str, str] = {
    "batch": "on_batch",
    "post_update": "after_update",
    "metrics": "metrics",
    "alert": "alert",
    "bar": "bar_fields",
    "summary": "summary_lines",
    "final_warnings": "final_warnings",
    "state": "state_dict",
    "close": "close",
}


class TrainHook:
    """A trainer extension: declares its ``stages`` (keys of :data:`STAGES`) and implements their
    methods; the defaults below do nothing.

    The trainer calls :meth:`register` once, when it is built; the default registers every stage
    of ``stages``. A hook that decides its stages from its own state overrides it and calls
    ``trainer.register_op(stage, self)`` for each.
    """

    name = "hook"
    stages: Tuple[str, ...] = ()

    def register(self, trainer) -> None:
        for stage in self.stages:
            trainer.register_op(stage, self)

    def on_batch(self, batch, trainer):
        return batch

    def after_update(self, trainer) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        return {}

    def alert(self, metrics: Dict[str, float]) -> Optional[str]:
        return None

    def bar_fields(self, metrics: Dict[str, float]) -> List[str]:
        return []

    def summary_lines(self, metrics: Dict[str, float]) -> List[str]:
        return []

    def final_warnings(self, metrics: Dict[str, float]) -> List[str]:
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self, save: bool = True) -> None:
        pass
