"""What ONI's one-call stack costs a TorchRL user on ``GymEnv("NetHackScore-v0")``, one core.

Rows (random actions, ``step_and_maybe_reset``, measured in interleaved rounds, median round):
  GymEnv                      TorchRL's ``GymEnv("NetHackScore-v0")`` alone: the baseline (its
                              stored rollouts are wrong: NLE reuses its arrays)
  + copy, hash, count         the env-side keys of :mod:`torchrl_oni.envs.caption_keys`
                              (``CopyAliasedObservations`` copies every observation of this env)
  + oni_transforms            the whole stack: the keys, annotation (scripted rules, background
                              thread) and the ONI-Retrieval reward mixed into ``reward``

Usage: ``python benchmarks/drop_in_overhead.py --seconds 60 [--rounds 5]``
The last line of output is one JSON object: fps per row and ``ratio`` = stack / GymEnv.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from env_throughput import _interleaved, _torchrl_loop


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="total measuring time")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from torchrl.envs import Compose, GymEnv, TransformedEnv

    import torchrl_oni  # noqa: F401
    from torchrl_oni.annotators import ScriptedAnnotator
    from torchrl_oni.envs.caption_keys import CaptionHash, CopyAliasedObservations, MessageCounter
    from torchrl_oni.stack import oni_transforms

    def gym():
        env = GymEnv("NetHackScore-v0")
        env.set_seed(0)
        return env

    stack = oni_transforms(annotator=ScriptedAnnotator(), intrinsic_coeff=0.4)
    configs = {
        "GymEnv": _torchrl_loop(gym()),
        "+ copy, hash, count": _torchrl_loop(TransformedEnv(gym(), Compose(
            CopyAliasedObservations(), CaptionHash(), MessageCounter()))),
        "+ oni_transforms": _torchrl_loop(TransformedEnv(gym(), stack)),
    }
    try:
        fps = _interleaved(configs, args.seconds, args.rounds)
    finally:
        for _, close in configs.values():
            close()
    base = fps["GymEnv"]
    print(f"{'configuration':24s} {'frames/s':>10s} {'vs GymEnv':>10s}")
    for name, value in fps.items():
        print(f"{name:24s} {value:10,.0f} {value / base:10.2f}")
    print(json.dumps({"benchmark": "drop_in_overhead", "fps": {k: round(v, 1) for k, v in fps.items()},
                      "keys_ratio": round(fps["+ copy, hash, count"] / base, 3),
                      "ratio": round(fps["+ oni_transforms"] / base, 3),
                      "seconds": args.seconds, "rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
