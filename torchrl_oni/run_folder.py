"""What a run folder holds: one name per file, for the trainer that writes them and for every
tool that reads them (``oni-eval``, ``oni-plot``, ``oni-replay``, ``--resume``, the benchmarks).

=======================  =======================  ==========================================================
name                     file                     written by, read by
=======================  =======================  ==========================================================
``CONFIG_NAME``          ``config.yaml``          the trainer (the resolved configuration); ``--resume``, oni-eval
``CHECKPOINT_NAME``      ``checkpoint.pt``        the trainer; ``--resume``, oni-eval
``METRICS_NAME``         ``metrics.csv``          the trainer's run log; oni-plot, the tutorials, benchmarks
``CAPTION_STORE_NAME``   ``captions.pt``          the intrinsic-reward hook (captions and labels); oni-eval
``TOP_MESSAGES_NAME``    ``top_messages.txt``     the intrinsic-reward hook (most seen captions, their labels)
``EVAL_NAME``            ``eval.json``            oni-eval; oni-plot, benchmarks, oni-label (flagged captions first)
``REWARD_HACKING_NAME``  ``reward_hacking.json``  the intrinsic-reward hook at the end of a run; oni-label
``REPLAY_DIR``           ``replays/``             ``oni-eval --record``; oni-replay
=======================  =======================  ==========================================================

Example:
    >>> import os
    >>> from torchrl_oni.run_folder import CHECKPOINT_NAME
    >>> os.path.join("runs/oni", CHECKPOINT_NAME)
    'runs/oni/checkpoint.pt'
"""
CONFIG_NAME = "config.yaml"
CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.csv"
CAPTION_STORE_NAME = "captions.pt"
TOP_MESSAGES_NAME = "top_messages.txt"
EVAL_NAME = "eval.json"
REWARD_HACKING_NAME = "reward_hacking.json"
REPLAY_DIR = "replays"

__all__ = ["CONFIG_NAME", "CHECKPOINT_NAME", "METRICS_NAME", "CAPTION_STORE_NAME", "TOP_MESSAGES_NAME",
           "EVAL_NAME", "REWARD_HACKING_NAME", "REPLAY_DIR"]
