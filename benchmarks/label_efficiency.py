"""Label efficiency: held-out accuracy of the classification reward vs labels queried, by query rule.

1. Collect a pool of real NetHack captions: a uniformly random policy plays ``--envs`` games of
   :class:`~torchrl_oni.envs.NLEBatchEnv` for ``--env-steps`` steps each (random characters by
   default, for more distinct messages). The empty caption is left out.
2. The answer key is the noiseless rules annotator; a fixed slice of captions (chosen by hash,
   ``--test-fraction``) is the held-out test set, the rest is the pool to query from.
3. For each seed and each rule (``uniform``, ``disagree``, ``entropy``): an ensemble of
   ``--members`` classifiers (:class:`~torchrl_oni.rewards.ensemble.ClassifierEnsemble`, bootstrap
   resamples) starts from ``--initial`` uniformly chosen labels, then queries rounds of captions
   chosen by the rule (:func:`torchrl_oni.queries.select` on the members' predictions), labelled by
   a **noisy** simulated teacher (:class:`~torchrl_oni.annotators.teacher.SimulatedTeacher`,
   ``--beta``, ``--epsilon``), and trains ``--steps-per-round`` steps after each round. At each
   budget the ensemble's reward (mean P(helpful) > 0.5) is scored on the test set.

Positives are rare (a few % of distinct captions), so the table reports **balanced accuracy**
(mean of the recalls of both classes); plain accuracy and the number of true positives among
the queried captions are in the JSON. Budgets larger than the pool are dropped (say so).

Usage::

    python benchmarks/label_efficiency.py                          # the real measurement (long)
    python benchmarks/label_efficiency.py --env-steps 300 --budgets 20 40 --seeds 0 \\
        --members 2 --steps-per-round 5 --initial 10                # a smoke check

Prints a table, then, as the LAST line, one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torchrl_oni.queries import select  # noqa: E402
from torchrl_oni.annotators.scripted import ScriptedAnnotator  # noqa: E402
from torchrl_oni.annotators.teacher import SimulatedTeacher  # noqa: E402
from torchrl_oni.atomic import atomic_write  # noqa: E402
from torchrl_oni.captions import MESSAGE_LEN, decode_messages  # noqa: E402
from torchrl_oni.rewards.ensemble import ClassifierEnsemble, EnsembleClassifierTrainer  # noqa: E402
from torchrl_oni.rewards.training import holdout_mask  # noqa: E402

RULES = ("uniform", "disagree", "entropy")


def collect_pool(envs: int, steps: int, seed: int, character: str):
    """Distinct non-empty captions a random policy sees: ``(messages uint8[U,256], hashes, counts)``."""
    from torchrl_oni.envs import NLEBatchEnv

    env = NLEBatchEnv("score", num_envs=envs, seed=seed, task_kwargs={"character": character})
    first = {}
    counts = {}
    td = env.reset()
    try:
        for _ in range(steps):
            td.set("action", env.action_spec.rand())
            td, nxt = env.step_and_maybe_reset(td)
            hashes = td["next", "caption_hash"].numpy()
            uniq, idx, cnt = np.unique(hashes, return_index=True, return_counts=True)
            for h, i, c in zip(uniq.tolist(), idx.tolist(), cnt.tolist()):
                if h not in first:
                    first[h] = td["next", "message"][i].numpy().copy()
                counts[h] = counts.get(h, 0) + c
            td = nxt
    finally:
        env.close()
    keep = [h for h, m in first.items() if m[0] != 0]
    messages = np.stack([first[h] for h in keep]) if keep else np.zeros((0, MESSAGE_LEN), np.uint8)
    return messages, np.array(keep, dtype=np.int64), np.array([counts[h] for h in keep], dtype=np.int64)


class LabelSet:
    """The queried captions and the teacher's labels: the trainer's ``labelled()`` store."""

    def __init__(self, messages: torch.Tensor, hashes: torch.Tensor):
        self.messages, self.hashes = messages, hashes
        self.index, self.values = [], []

    def add(self, index, labels):
        self.index.extend(index)
        self.values.extend(labels)

    def labelled(self):
        idx = torch.as_tensor(self.index, dtype=torch.int64)
        return self.messages[idx], self.hashes[idx], torch.tensor(self.values, dtype=torch.float32)


def scores(ensemble, messages, truth):
    pred = ensemble(messages, torch.zeros(len(messages), dtype=torch.int64)).numpy() > 0.5
    recalls = [float((pred[truth == c] == c).mean()) for c in (False, True) if (truth == c).any()]
    return float((pred == truth).mean()), float(np.mean(recalls))


def run_one(rule, seed, pool_msgs, pool_hashes, test_msgs, test_truth, pool_truth, budgets, args):
    """Returns ``{budget: (accuracy, balanced_accuracy, positives_found)}`` for one rule and seed."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    teacher = SimulatedTeacher(beta=args.beta, epsilon=args.epsilon, seed=seed)
    texts = decode_messages(pool_msgs.numpy())
    labels = LabelSet(pool_msgs, pool_hashes)
    ensemble = ClassifierEnsemble(size=args.members, seed=seed)
    trainer = EnsembleClassifierTrainer(ensemble, labels, lr=args.lr, batch_size=args.batch_size,
                                        holdout_fraction=0.0, seed=seed)
    remaining = np.arange(len(pool_msgs))
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for budget in budgets:
        while len(labels.index) < budget:
            have = len(labels.index)
            if have < args.initial:
                k = args.initial - have
            else:
                k = max(args.min_round, int(args.round_frac * have))
            k = min(k, budget - have, len(remaining))
            if k <= 0:
                break
            if have < args.initial or rule == "uniform":
                picked = rng.permutation(len(remaining))[:k]
            else:
                with torch.no_grad():
                    probs = ensemble.member_probabilities(pool_msgs[remaining])
                picked = select({"member_probs": probs}, k, rule, generator=generator).numpy()
            chosen = remaining[picked]
            remaining = np.delete(remaining, picked)
            answers = [teacher.label(texts[i]) for i in chosen]
            kept = [(int(i), a) for i, a in zip(chosen, answers) if a is not None]
            labels.add([i for i, _ in kept], [a for _, a in kept])
            if len(labels.index) == have:  # everything skipped and nothing left to try
                break
            trainer.train_steps(args.steps_per_round)
        acc, bal = scores(ensemble, test_msgs, test_truth)
        out[budget] = (acc, bal, int(pool_truth[labels.index].sum()))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[50, 100, 200, 500, 1000, 2000])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--envs", type=int, default=16, help="games played by the random policy")
    p.add_argument("--env-steps", type=int, default=20_000, help="steps per game of the random policy")
    p.add_argument("--character", default="@", help="NetHack character ('@': random role)")
    p.add_argument("--pool", default=None, help="cache the caption pool in this .npz file (reused when present)")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--initial", type=int, default=20, help="labels chosen uniformly before any rule applies")
    p.add_argument("--round-frac", type=float, default=0.25, help="each round queries this share of the labels so far")
    p.add_argument("--min-round", type=int, default=10)
    p.add_argument("--steps-per-round", type=int, default=50, help="gradient steps per member after each round")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=2.0, help="teacher rationality (inf: no choice noise)")
    p.add_argument("--epsilon", type=float, default=0.05, help="teacher mistake rate")
    p.add_argument("--seconds", type=float, default=float("inf"), help="stop starting new runs after this long")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.perf_counter()

    if args.pool and os.path.exists(args.pool):
        data = np.load(args.pool, allow_pickle=False)
        messages, hashes, counts = data["messages"], data["hashes"], data["counts"]
    else:
        messages, hashes, counts = collect_pool(args.envs, args.env_steps, 0, args.character)
        if args.pool:
            atomic_write(args.pool, lambda f: np.savez(f, messages=messages, hashes=hashes, counts=counts))
    collect_s = time.perf_counter() - t0
    rules_annotator = ScriptedAnnotator()
    truth = np.array([rules_annotator.label(t) > 0.5 for t in decode_messages(messages)], dtype=bool)
    test = holdout_mask(torch.from_numpy(hashes), args.test_fraction).numpy()
    pool_msgs, pool_hashes = torch.from_numpy(messages[~test]), torch.from_numpy(hashes[~test])
    test_msgs, test_truth, pool_truth = torch.from_numpy(messages[test]), truth[test], truth[~test]
    budgets = sorted(b for b in set(args.budgets) if b <= len(pool_msgs))
    dropped = sorted(set(args.budgets) - set(budgets))
    print(f"caption pool: {len(messages)} distinct ({int(truth.sum())} progress by the rules), "
          f"{len(pool_msgs)} to query, {int(test.sum())} held out ({int(test_truth.sum())} progress); "
          f"collected in {collect_s:.0f} s" + (f"; budgets above the pool dropped: {dropped}" if dropped else ""))

    results = {rule: {b: [] for b in budgets} for rule in args.rules}
    runs_done = 0
    complete = True
    for seed in args.seeds:
        for rule in args.rules:
            if time.perf_counter() - t0 > args.seconds:
                complete = False
                break
            for b, value in run_one(rule, seed, pool_msgs, pool_hashes, test_msgs, test_truth, pool_truth,
                                    budgets, args).items():
                results[rule][b].append(value)
            runs_done += 1

    def cell(values, k):
        if not values:
            return "—"
        xs = np.array([v[k] for v in values], dtype=float)
        return f"{xs.mean():.3f}±{xs.std():.3f}" if k < 2 else f"{xs.mean():.1f}"

    seeds_done = {r: len(results[r][budgets[0]]) if budgets else 0 for r in args.rules}
    print(f"\nheld-out balanced accuracy (mean±std over the seeds run: "
          + ", ".join(f"{r} {n}" for r, n in seeds_done.items())
          + f"{'' if complete else '; --seconds ran out'}), teacher beta={args.beta} "
          f"epsilon={args.epsilon}, {args.members} members")
    print(f"{'labels':>7} " + " ".join(f"{r:>14}" for r in args.rules))
    for b in budgets:
        print(f"{b:>7} " + " ".join(f"{cell(results[r][b], 1):>14}" for r in args.rules))
    print("\ntrue positives among the queried captions (mean)")
    for b in budgets:
        print(f"{b:>7} " + " ".join(f"{cell(results[r][b], 2):>14}" for r in args.rules))

    summary = {
        "benchmark": "label_efficiency",
        "budgets": budgets,
        "seeds_done": seeds_done,
        "pool": int(len(pool_msgs)), "test": int(test.sum()),
        "pool_positives": int(pool_truth.sum()), "test_positives": int(test_truth.sum()),
        "teacher": {"beta": args.beta, "epsilon": args.epsilon}, "members": args.members, "seeds": args.seeds,
        "steps_per_round": args.steps_per_round, "runs_done": runs_done, "complete": complete,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    for rule in args.rules:
        for name, k in (("balanced_accuracy", 1), ("accuracy", 0), ("positives_found", 2)):
            vals = [[v[k] for v in results[rule][b]] for b in budgets]
            summary[f"{rule}_{name}_mean"] = [round(float(np.mean(v)), 4) if v else None for v in vals]
            if k == 1:
                summary[f"{rule}_{name}_std"] = [round(float(np.std(v)), 4) if v else None for v in vals]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
