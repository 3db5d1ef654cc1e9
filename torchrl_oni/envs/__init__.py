"""NetHack envs for ONI: the tasks (gymnasium) and the batched TorchRL env."""
from ..task_ids import TASKS, TASK_ALIASES, resolve_task, task_names
from .tasks import ONITask, make_task
from .batched import NLEBatchEnv, EPISODE_STATS

__all__ = ["TASKS", "TASK_ALIASES", "ONITask", "make_task", "resolve_task", "task_names", "NLEBatchEnv", "EPISODE_STATS"]
