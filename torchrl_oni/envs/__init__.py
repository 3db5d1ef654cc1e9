"""NetHack envs for ONI: the tasks (gymnasium) and the batched TorchRL env."""
from .tasks import TASKS, TASK_ALIASES, ONITask, make_task, resolve_task, task_names
from .batched import NLEBatchEnv, EPISODE_STATS

__all__ = ["TASKS", "TASK_ALIASES", "ONITask", "make_task", "resolve_task", "task_names", "NLEBatchEnv", "EPISODE_STATS"]
