"""An env worker's rollout without per-step packaging: TorchRL's ``Collector`` whose hot loop writes
straight into the batch it returns.

TorchRL's ``Collector.rollout`` builds a TensorDict every step (the env's output, the carrier's
step_mdp copy, its reset merge), updates the carrier key by key, then stacks the T per-step
TensorDicts into its preallocated ``[K, T]`` batch: with K = 32 NetHack games and the light
policy on one thread, that bookkeeping and the env's own per-step TensorDict took about 30 % of a
worker's time, NetHack itself about half. :class:`NLERolloutCollector` fills the same
preallocated batch (``self._final_rollout``) in place: numpy views of its leaves are taken once
per rollout, the games of an :class:`~torchrl_oni.envs.NLEBatchEnv` write step t's
observations into ``("next", ...)[:, t]``, the root of step t + 1 is that next-observation, or
the reset observation for the games that ended (TorchRL's semantics), and the policy's logits,
action and log-probability go into ``[:, t]``. ``("collector", "traj_ids")`` advance from the
collector's trajectory pool as TorchRL's ``_update_traj_ids`` does, and the carrier left behind
is TorchRL's, so a later rollout on TorchRL's path continues where this one stopped.

The fast path runs when the env is a plain ``NLEBatchEnv``, or one under a recurrent policy's
``InitTracker`` and zero ``TensorDictPrimer`` (whose keys it writes as those transforms do), the
policy is an :class:`~torchrl_oni.train.policy.ActingActor` with a feed-forward
:class:`~torchrl_oni.train.policy.PlainStep` (computed on plain tensors) or a policy server's
:class:`~torchrl_oni.train.acting.WorkerPolicy` (asked once a step with a TensorDict of its inputs
only; with ``PolicyServer(splits=)`` once per group of games, one group stepping NetHack while the
server computes another's actions), everything is on the CPU, and none of the
collector's unusual options is on (replay buffer, interruptor, ``reset_at_each_iter``, random
frames, ``compact_obs``, trajectories per batch, compiled policies); anything else calls
TorchRL's ``rollout``. ``tests/test_rollout.py`` compares both paths leaf by leaf.

Example:
    >>> import torch
    >>> from torchrl.collectors import Collector
    >>> from torchrl_oni.envs import NLEBatchEnv
    >>> from torchrl_oni.train._rollout import NLERolloutCollector
    >>> from torchrl_oni.train.policy import acting_copy, make_actor_critic
    >>> def batches(cls, n=3):
    ...     env = NLEBatchEnv("score", num_envs=2, seed=0, task_kwargs={"max_episode_steps": 5})
    ...     torch.manual_seed(0)
    ...     policy = acting_copy(make_actor_critic(env)[0])
    ...     collector = cls(env, policy, frames_per_batch=8, total_frames=8 * n, device="cpu",
    ...                     storing_device="cpu", auto_register_policy_transforms=False)
    ...     out = [batch for batch in collector]
    ...     collector.shutdown()
    ...     return out, collector
    >>> fast, collector = batches(NLERolloutCollector)
    >>> torchrl, _ = batches(Collector)
    >>> collector.fast_rollouts, fast[0].batch_size
    (3, torch.Size([2, 4]))
    >>> all((a == b).all() for a, b in zip(fast, torchrl))
    True
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn.probabilistic import InteractionType, interaction_type
from torchrl.collectors import Collector
from torchrl.envs import Compose, InitTracker, TensorDictPrimer, TransformedEnv
from torchrl.envs.utils import set_exploration_type

from ..envs.batched import NLEBatchEnv
from .policy import ActingActor

__all__ = ["NLERolloutCollector"]

_DRAWN = (InteractionType.RANDOM, InteractionType.MODE, InteractionType.DETERMINISTIC)
_TRAJ_KEY = ("collector", "traj_ids")


def _key(key) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def _recurrent_transforms(env) -> Optional[tuple]:
    """``(base env, primed keys, init key)`` when ``env``'s transforms are a recurrent policy's
    (``InitTracker`` and a ``TensorDictPrimer`` of zeros, in either order), else None."""
    transforms = list(env.transform) if isinstance(env.transform, Compose) else [env.transform]
    trackers = [t for t in transforms if type(t) is InitTracker]
    primers = [t for t in transforms if type(t) is TensorDictPrimer]
    if len(trackers) != 1 or len(primers) != 1 or len(transforms) != 2:
        return None
    tracker, primer = trackers[0], primers[0]
    if len(tracker.init_keys) != 1 or primer.random or getattr(primer, "call_before_env_reset", False):
        return None
    defaults = primer.default_value
    keys = tuple(_key(k) for k in primer.primers.keys(True, True))
    if not isinstance(defaults, dict) or set(map(_key, defaults)) != set(keys) \
            or any(not isinstance(v, (int, float)) or v != 0 for v in defaults.values()):
        return None
    return env.base_env, keys, _key(tracker.init_keys[0])


def _by_step(arrays: dict, T: int) -> list:
    """Step t's views ``[:, t]`` of each ``[K, T, ...]`` array for t < T, then fresh arrays for
    step T (the root the next carrier starts from)."""
    return ([{k: a[:, t] for k, a in arrays.items()} for t in range(T)]
            + [{k: np.empty_like(a[:, 0]) for k, a in arrays.items()}])


class _Plan(NamedTuple):
    fields: dict  # name -> root key (tuple) of the env's entries
    base: NLEBatchEnv  # the games (the env, or the env under its recurrent transforms)
    recurrent: tuple  # the primer's root keys (tuples): ("next", key) from the policy, zeros at a reset
    init_key: Optional[tuple]  # InitTracker's key (True at a reset), or None
    step: object  # the policy's PlainStep, or None: a served policy's client, called on a TensorDict
    policy_keys: tuple  # the policy's outputs (tuples); with a PlainStep: logits, action, log-prob
    in_keys: tuple  # the policy's inputs (tuples)
    random: bool  # draw the action (else argmax; PlainStep only)


class _Memory:
    """A recurrent policy's keys on the in-place path: the primed state at step t + 1 is the
    policy's ``("next", key)`` of step t, zeros for the games that reset; InitTracker's key is
    False after a step and True at a reset (TorchRL's transforms, written into the batch)."""

    def __init__(self, plan: _Plan, fr: TensorDict, carrier: TensorDict):
        T = fr.batch_size[1]
        self.keys = list(plan.recurrent)
        self.init_key = plan.init_key
        every = self.keys + ([self.init_key] if self.init_key else [])
        roots = {k: fr.get(k).numpy() for k in every}
        for k in every:
            roots[k][:, 0] = carrier.get(k).numpy()
        self.roots = _by_step(roots, T)
        self.last = self.roots[T]  # the next carrier's
        self.state_out = {k: fr.get(("next",) + k).numpy() for k in self.keys}
        self.init_out = fr.get(("next",) + self.init_key).numpy() if self.init_key else None

    def carry(self, t: int, at: slice, ended: list) -> None:
        then = self.roots[t + 1]
        for k in self.keys:
            then[k][at] = self.state_out[k][at, t]
            if ended:
                then[k][ended] = 0
        if self.init_key:
            self.init_out[at, t] = False
            then[self.init_key][at] = False
            if ended:
                then[self.init_key][ended] = True


class NLERolloutCollector(Collector):
    """TorchRL's single-process ``Collector`` whose ``rollout`` fills its preallocated batch in
    place when it can (see the module's docstring), and is TorchRL's own otherwise.

    Attributes:
        fast_rollouts: rollouts made on the in-place path (the others took TorchRL's).
    """

    fast_rollouts: int = 0

    @torch.no_grad()
    def rollout(self) -> TensorDictBase:
        plan = self._fast_plan()
        if plan is None:
            return super().rollout()
        if self.pre_collect_hook is not None:
            self.pre_collect_hook()
        with set_exploration_type(self.exploration_type):
            result = self._fast_rollout(plan)
        self.fast_rollouts += 1
        return self._maybe_set_truncated(result)

    # ------------------------------------------------------------------ when
    def _fast_plan(self) -> Optional[_Plan]:
        """What the in-place path needs, or None where TorchRL's rollout must run."""
        env = self.env
        base, recurrent, init_key = env, (), None
        if type(env) is TransformedEnv:  # a recurrent policy's env: InitTracker and a zero primer only
            found = _recurrent_transforms(env)
            if found is None:
                return None
            base, recurrent, init_key = found
        if type(base) is not NLEBatchEnv or len(base.batch_size) != 1:
            return None
        # (TransformedEnv always has the hook; InitTracker's and TensorDictPrimer's do nothing)
        if (base._post_step_mdp_hooks is not None or base.run_type_checks
                or env.run_type_checks or not base._cpu
                or base.__dict__.get("_compiled_step_and_maybe_reset") is not None
                or env.__dict__.get("_compiled_step_and_maybe_reset") is not None
                or base.__dict__.get("_torchrl_native_autoreset", False) or base._live["state"] is None):
            return None
        fr = getattr(self, "_final_rollout", None)
        if (not isinstance(fr, TensorDict) or self.replay_buffer is not None or self.interruptor is not None
                or self.reset_at_each_iter or self._should_use_random_frames() or self._compact_next_keys
                or not self._use_buffers or self.compiled_policy or self.cudagraphed_policy
                or self._cast_to_policy_device or self._cast_to_env_device or self._carrier_has_no_device
                or getattr(self, "trajs_per_batch", None) is not None
                or getattr(self, "_final_rollout_needs_init", False)):
            return None
        for device in (self.storing_device, self.policy_device, self.env_device, fr.device):
            if device is None or torch.device(device).type != "cpu":
                return None
        policy = self._wrapped_policy
        step = getattr(policy, "plain_step", None)
        random = False
        if type(policy) is ActingActor and step is not None and step.gru is None and not recurrent:
            from torchrl.modules.tensordict_module.rnn import recurrent_mode

            if recurrent_mode():
                return None
            with set_exploration_type(self.exploration_type):
                kind = interaction_type() or step.default_interaction
            if kind not in _DRAWN:
                return None
            random = kind is InteractionType.RANDOM
            policy_keys = (("logits",), _key(step.action_key), _key(step.log_prob_key))
            in_keys = tuple(_key(k) for k in step.in_keys)
        else:
            # a policy server's client: it reads its in_keys and writes its out_keys, nothing else
            from .acting import WorkerPolicy

            if type(policy) is not WorkerPolicy:
                return None
            step = None
            policy_keys = tuple(_key(k) for k in policy.out_keys)
            in_keys = tuple(_key(k) for k in policy.in_keys)
            if _key(env.action_key) not in policy_keys:
                return None
        if not all(("next",) + k in policy_keys for k in recurrent):
            return None  # a primed key the policy does not carry forward
        fields = {name: _key(key) for name, key in base.rollout_fields().items()}
        if {_key(k) for k in self._policy_output_keys} != set(policy_keys):
            return None
        K, T = env.batch_size[0], self.frames_per_batch
        if fr.batch_size != torch.Size([K, T]):
            return None
        obs_keys = set(fields.values())
        root_only = set(recurrent) | ({init_key} if init_key else set())
        if not all(k in obs_keys or k in root_only for k in in_keys):
            return None
        # exactly the leaves this path writes: anything else (a transform's key...) is TorchRL's
        traj = {_TRAJ_KEY} if self.track_traj_ids else set()
        expected = (obs_keys | set(policy_keys) | traj | {("next",) + k for k in obs_keys} | {("next", "reward")}
                    | root_only | ({("next",) + init_key} if init_key else set()))
        if {_key(k) for k in fr.keys(True, True)} != expected:
            return None
        carrier = self._carrier
        if not isinstance(carrier, TensorDict) or carrier.batch_size != env.batch_size:
            return None
        held = {_key(k) for k in carrier.keys(True, True)}
        carried_policy = {k for k in policy_keys if k[0] != "next"}
        if not (obs_keys | traj | root_only) <= held <= (obs_keys | traj | root_only | carried_policy):
            return None
        return _Plan(fields, base, tuple(recurrent), init_key, step, policy_keys, in_keys, random)

    # ------------------------------------------------------------------ how
    def _fast_rollout(self, plan: _Plan) -> TensorDictBase:
        env, base, fr, fields = self.env, plan.base, self._final_rollout, plan.fields
        K, T = fr.batch_size
        # numpy views, taken per rollout: the multiprocess runner moves the batch to shared memory
        root = {name: fr.get(key).numpy() for name, key in fields.items()}
        nxt = {name: fr.get(("next",) + key).numpy() for name, key in fields.items()}
        nxt["reward"] = fr.get(("next", "reward")).numpy()
        roots = _by_step(root, T)
        new_root = roots[T]  # the next carrier's
        nexts = [{name: arr[:, t] for name, arr in nxt.items()} for t in range(T)]
        carrier = self._carrier
        for name, key in fields.items():
            roots[0][name][...] = carrier.get(key).numpy()
        memory = _Memory(plan, fr, carrier)
        game_blstats = base._live["state"]["game_blstats"].copy()

        step = plan.step
        net = step.net if step is not None else None
        policy = self._wrapped_policy
        inputs = [fr.get(k) for k in plan.in_keys]
        policy_out = [fr.get(k) for k in plan.policy_keys]
        action_at = plan.policy_keys.index(_key(env.action_key))
        track = self.track_traj_ids
        traj = carrier.get(_TRAJ_KEY).numpy().copy() if track else None
        traj_out = fr.get(_TRAJ_KEY).numpy() if track else None
        splits = 1 if net is not None else policy.splits
        groups = [range(g * K // splits, (g + 1) * K // splits) for g in range(splits)]
        sizes = [torch.Size([len(rows)]) for rows in groups]
        in_keys = [k[0] if len(k) == 1 else k for k in plan.in_keys]
        carried = list(fields)

        def ask(g: int, t: int):  # the served policy: group g's request for step t, sent without waiting
            rows = slice(groups[g].start, groups[g].stop)
            return policy.submit(g, TensorDict({k: x[rows, t] for k, x in zip(in_keys, inputs)}, batch_size=sizes[g]))

        # Served, the games go in groups (PolicyServer(splits=)): group g's NetHack steps while the
        # server computes the other groups' actions, and its request for step t + 1 leaves as soon as
        # its step t is written, so the games see exactly the observations of one group. The groups
        # are rows in order: ended games take new trajectory ids in TorchRL's row order.
        pending = [ask(g, 0) for g in range(splits)] if net is None else None
        done_rows: list = []
        actions = None
        if net is not None:  # each step's views of the batch, made at once (indexing is a call per view)
            inputs_at = list(zip(*(x.unbind(1) for x in inputs)))
            outputs_at = list(zip(*(dest.unbind(1) for dest in policy_out)))
        for t in range(T):
            if net is not None:  # PlainStep's own step (feed-forward), on the batch's views
                logits = net(*inputs_at[t])
                drawn = (logits, *step.draw(logits, plan.random))
                for dest, value in zip(outputs_at[t], drawn):
                    dest.copy_(value)
                actions = drawn[action_at].tolist()
            if track:
                traj_out[:, t] = traj
            # the games: step t's next-observation, then the root of step t + 1
            out, then = nexts[t], roots[t + 1]
            done_rows = []
            for g, rows in enumerate(groups):
                at = slice(rows.start, rows.stop)
                if net is None:
                    answer = policy.wait(pending[g])
                    for dest, key in zip(policy_out, plan.policy_keys):
                        dest[at, t] = answer.get(key)
                    actions = answer.get(plan.policy_keys[action_at]).tolist()
                ended = base._step_into(actions, out, game_blstats, None if splits == 1 else rows)
                for name in carried:
                    np.copyto(then[name][at], out[name][at])
                if ended:
                    base._reset_into(ended, then, game_blstats)
                    if track:  # TorchRL's _update_traj_ids: new ids from the pool, in row order
                        traj[ended] = self._traj_pool.get_traj_and_increment(len(ended), device="cpu").numpy()
                    done_rows += ended
                memory.carry(t, at, ended)
                if net is None and t + 1 < T:
                    pending[g] = ask(g, t + 1)
        base._adopt_state(new_root, game_blstats)
        outputs = [dest[:, T - 1] for dest in policy_out]
        self._carrier = self._next_carrier(plan, new_root, memory.last, outputs, done_rows, traj)
        return fr

    def _next_carrier(self, plan: _Plan, new_root: dict, memory: dict, outputs, done_rows: list,
                      traj) -> TensorDict:
        """The carrier TorchRL leaves after the rollout's last step: its root (step_mdp then the
        partial reset, the recurrent transforms' keys included), the policy's outputs carried over
        (zeros for the games just reset, as ``_update_during_reset`` pads them, unless every game
        was) and the trajectory ids."""
        env = self.env
        K = env.batch_size[0]
        carrier = TensorDict({}, batch_size=env.batch_size, device=env.device)
        for name, key in plan.fields.items():
            carrier.set(key, torch.from_numpy(new_root[name]))
        for key, value in memory.items():
            carrier.set(key, torch.from_numpy(value))
        for key, value in zip(plan.policy_keys, outputs):
            if key[0] == "next":  # the policy's next recurrent state: the root's now
                continue
            value = value.clone()
            if done_rows and len(done_rows) < K:
                value[done_rows] = 0
            carrier.set(key, value)
        if traj is not None:
            carrier.set(_TRAJ_KEY, torch.from_numpy(traj))
        return carrier
