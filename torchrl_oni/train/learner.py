"""The PPO learner: one update on a batch ``[N, T]`` of N games' trajectories of T steps.

``GAE`` → ``ClipPPOLoss`` → Adam, on the learner's device, timed per stage
(:class:`~torchrl_oni.train.timing.StageClock`). The trainer hands it batches; the benchmark
``benchmarks/learner_throughput.py`` hands it synthetic ones.

What it does beyond a textbook TorchRL PPO update, and why (profiled on the 2-core CPU, light
policy, 1,024-frame batches: 49 ms an update before, GAE 25 % of it):

* **the critic runs once per observation for feed-forward policies** (:func:`feedforward_values`).
  TorchRL's ``GAE`` evaluates the critic on every observation *and* every next observation,
  although the next observation of step t is the observation of step t+1 except at an episode's
  end and at the rollout's last step. ``GAE(shifted=True)`` saves the second pass but bootstraps
  from the *next episode's* first observation at episode ends (advantages off by up to 1.85 on a
  batch with 32 truncations, measured), so the values are computed here and ``GAE`` only does the
  recursion. A single-layer GRU critic gets the same from one recurrent pass
  (:func:`recurrent_values`); an LSTM keeps TorchRL's path.
* **and once in all when the update is one minibatch of the whole batch** (one epoch, one value
  head: the defaults on the CPU and the GPU node's ``--minibatch-size`` = ``--frames-per-update``):
  the values GAE needs come from the loss's own critic pass, run first with its graph kept, and
  the critic loss is computed on them; for the GRU policy the shared trunk (encoder and GRU) runs
  once, and the loss runs only the heads on its output (the no-gradient pass was 14 % of an
  update with the light policy, 24 % with the GRU, 2-core CPU);
* **minibatches are cut from the keys the loss reads** (not the whole batch with its ``next``
  observations and episode statistics);
* **statistics stay on the device** until the end of the update and are read with one
  transfer (a ``float()`` per minibatch and statistic is a host–device sync on CUDA);
* **only the keys the update reads go to the device**, through a pinned buffer reused from one
  update to the next, without blocking (CUDA only); of a GRU policy's recurrent states only each
  row's first (:meth:`PPOLearner.pack_states`).

The loss, its hyperparameters and the meaning of every number are TorchRL's ``ClipPPOLoss``;
``tests/test_learner.py`` checks advantages, losses and gradients against TorchRL's own path.

Example:
    >>> import torch
    >>> from torchrl_oni.envs import NLEBatchEnv
    >>> from torchrl_oni.train.config import PPOConfig
    >>> from torchrl_oni.train.learner import PPOLearner
    >>> from torchrl_oni.train.policy import make_actor_critic
    >>> env = NLEBatchEnv("score", num_envs=4, seed=0)
    >>> actor, critic = make_actor_critic(env)
    >>> learner = PPOLearner(actor, critic, PPOConfig(minibatch_size=64), device=torch.device("cpu"))
    >>> with torch.no_grad():
    ...     batch = env.rollout(16, actor, break_when_any_done=False)
    >>> stats = learner.update(batch)
    >>> sorted(k for k in stats if k.startswith("train/loss"))
    ['train/loss_critic', 'train/loss_entropy', 'train/loss_objective']
    >>> "advantage" in batch.keys()
    True
    >>> env.close()
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch
from tensordict import TensorDictBase

from .timing import StageClock

__all__ = ["PPOLearner", "feedforward_values", "recurrent_values", "rollout_batch", "STAT_KEYS"]

# what each update reports (``train/<key>``), when the loss produces it
STAT_KEYS = ("loss_objective", "loss_critic", "loss_entropy", "entropy", "kl_approx", "clip_fraction", "grad_norm")


def feedforward_values(critic, batch: TensorDictBase, value_keys: Sequence[str],
                       pad_multiple: int = 1) -> Optional[torch.Tensor]:
    """Writes ``value_key`` and ``("next", value_key)`` into ``batch`` ``[N, T]`` with one pass
    of a feed-forward ``critic`` over the batch's observations plus the next observations that
    are not the following step's observation (episode ends and the rollout's last step).

    ``pad_multiple``: the next observations are padded (with copies of the last one, whose
    values are dropped) to a multiple of it, so that the critic sees few distinct input shapes
    from one batch to the next (a compiled critic recompiles, or records a CUDA graph, per shape).

    The result equals TorchRL's ``GAE`` with its value network (up to float rounding):
    ``tests/test_learner.py`` compares them on batches with terminations and truncations.

    Returns the first value key's values of the batch's own observations, ``[N * T, 1]``, with
    their graph when called with gradients enabled (the values written are detached), else None.
    """
    n, t = batch.shape[:2]
    keys = list(critic.in_keys)
    obs = batch.select(*keys)
    nxt = batch.get("next").select(*keys)
    need = batch.get(("next", "done")).reshape(n, t).clone()
    need[:, -1] = True
    extra = nxt[need]
    pad = -extra.shape[0] % pad_multiple
    if pad:
        extra = torch.cat([extra, extra[-1:].expand(pad)], 0)
    inputs = torch.cat([obs.reshape(-1), extra], 0)
    out = critic(inputs)
    kept = out.get(value_keys[0])[: n * t] if torch.is_grad_enabled() else None
    for key in value_keys:
        values = out.get(key).detach().clone()  # not a view of a compiled critic's (reused) output
        value = values[: n * t].reshape(n, t, -1)
        next_value = torch.empty_like(value)
        next_value[:, :-1] = value[:, 1:]
        next_value[need] = values[n * t : len(values) - pad]
        batch.set(key, value)
        batch.set(("next", key), next_value)
    return kept


def rollout_batch(arch: str = "light", games: int = 32, steps: int = 32, max_episode_steps: int = 200,
                  seed: int = 0, value_heads: int = 1):
    """``(actor, critic, batch)``: fresh networks and a real batch ``[games, steps]`` they played
    (episode ends inside it when ``max_episode_steps < steps``), with standard-normal rewards —
    what the learner is handed, for benchmarks and tests of the learner alone."""
    from .config import TrainConfig
    from .policy import make_actor_critic, recurrent_primer
    from .env_factory import make_env_factory

    torch.manual_seed(seed)
    cfg = TrainConfig(envs_per_worker=games, rollout=steps, max_episode_steps=max_episode_steps, seed=seed)
    probe = make_env_factory(cfg, 0)()
    actor, critic = make_actor_critic(probe, arch=arch, value_heads=value_heads)
    probe.close()
    primer = recurrent_primer(actor)
    env = make_env_factory(cfg, 0, primer.primers if primer is not None else None)()
    try:
        with torch.no_grad():
            batch = env.rollout(steps, actor, break_when_any_done=False)
    finally:
        env.close()
    gen = torch.Generator().manual_seed(seed)
    reward = torch.randn(batch.get(("next", "reward")).shape, generator=gen)
    batch.set(("next", "reward"), reward)
    if value_heads == 2:
        batch.set(("next", "reward_ext"), reward)
        batch.set(("next", "reward_int"), torch.randn(reward.shape, generator=gen))
    return actor, critic, batch


def _single_gru(critic):
    """The critic's GRU core when it has exactly one single-layer ``GRUModule`` (its output at each
    step is then its hidden state), else None."""
    from torchrl.modules import GRUModule

    cores = [m for m in critic.modules() if isinstance(m, GRUModule)]
    if len(cores) != 1 or cores[0].gru.num_layers != 1:
        return None
    return cores[0]


def recurrent_values(critic, batch: TensorDictBase, value_keys: Sequence[str]) -> None:
    """:func:`feedforward_values` for a critic with one single-layer GRU core: one recurrent pass
    over the batch's observations gives every value and every step's hidden state; the next
    observations that are not the following step's (episode ends, the rollout's last step) get
    one GRU step from the hidden state after their own step.

    TorchRL's ``GAE`` runs the encoder and GRU over every observation and again over every next
    observation, the next sequence starting from the hidden states stored at acting time. The two
    agree when the weights are those the batch was played with (``tests/test_learner.py``); after
    an update they differ by the policy lag, and these use the current weights throughout.
    """
    from torchrl.modules import set_recurrent_mode

    core = _single_gru(critic)
    keys = list(critic.in_keys)
    with set_recurrent_mode(True):
        out = critic(batch.select(*keys).copy())
    hidden = out.get(core.out_keys[0])  # [n, t, H]: the GRU's output, its hidden state after each step
    _write_recurrent_values(critic, batch, value_keys, out, hidden)


def _write_recurrent_values(critic, batch: TensorDictBase, value_keys: Sequence[str], out: TensorDictBase,
                            hidden: torch.Tensor) -> None:
    """The values of :func:`recurrent_values` from the recurrent pass's output ``out`` (the
    values of the batch's observations) and the GRU's ``hidden`` state after each step; written
    detached."""
    from torchrl.modules import set_recurrent_mode

    core = _single_gru(critic)
    n, t = batch.shape[:2]
    keys = list(critic.in_keys)
    need = batch.get(("next", "done")).reshape(n, t).clone()
    need[:, -1] = True
    nxt = batch.get("next").select(*keys)[need].copy()
    state_key = core.in_keys[1]  # the hidden state the GRU starts from
    nxt.set(state_key, hidden.detach()[need].unsqueeze(-2).to(nxt.get(state_key).dtype))
    nxt.set("is_init", torch.zeros_like(nxt.get("is_init")))
    with set_recurrent_mode(False), torch.no_grad():
        last = critic(nxt)
    for key in value_keys:
        value = out.get(key).detach()
        next_value = torch.empty_like(value)
        next_value[:, :-1] = value[:, 1:]
        next_value[need] = last.get(key)
        batch.set(key, value)
        batch.set(("next", key), next_value)


class PPOLearner:
    """ClipPPOLoss, GAE and Adam for a NetHack actor–critic.

    Args:
        actor, critic: from :func:`~torchrl_oni.train.policy.make_actor_critic`, on ``device``.
        ppo: the ``ppo`` section of :class:`~torchrl_oni.train.config.TrainConfig`.
        device: the learner's device.
        recurrent: the policy has a recurrent core (minibatches are whole trajectories).
        value_heads: 1 (one value of the mixed reward) or 2 (extrinsic and intrinsic heads).
        clock: where the stage times go (a fresh :class:`StageClock` by default).
        fast_values: one critic pass per observation for feed-forward policies
            (:func:`feedforward_values`); ``False`` uses TorchRL's ``GAE`` with its value network.
        compile_backend: ``torch.compile``'s backend where ``ppo.compile`` is on (tests use
            ``"aot_eager"``: the same graphs, without generating code).

    With ``ppo.compile`` (``--compile``), the feed-forward critic's values pass, the PPO loss and
    a recurrent policy's heads run through ``torch.compile``; the modules themselves are not
    replaced (checkpoints, hooks and acting copies see the same networks). A GRU's recurrent
    pass (trajectories split at every reset) stays eager.
    """

    def __init__(self, actor, critic, ppo, device: torch.device, recurrent: bool = False, value_heads: int = 1,
                 clock: Optional[StageClock] = None, fast_values: bool = True, compile_backend: str = "inductor"):
        from torchrl.objectives import ClipPPOLoss
        from torchrl.objectives.value import GAE

        self.actor, self.critic, self.ppo = actor, critic, ppo
        self.device = torch.device(device)
        self.recurrent = recurrent
        self.value_heads = value_heads
        self.clock = clock if clock is not None else StageClock()
        # one critic pass per observation: feed-forward critics, and single-layer GRU cores
        # (an LSTM's cell state is not in its output: TorchRL's path for it)
        self.fast_values = fast_values and (not recurrent or _single_gru(critic) is not None)
        self.suffixes = [""] if value_heads == 1 else ["_ext", "_int"]
        self.value_keys = ["state_value" + s for s in self.suffixes]

        def gae(suffix: str):
            estimator = GAE(gamma=ppo.gamma, lmbda=ppo.gae_lambda,
                            value_network=None if self.fast_values else critic,
                            average_gae=False, deactivate_vmap=recurrent)
            if suffix:
                estimator.set_keys(reward="reward" + suffix, value="state_value" + suffix,
                                   advantage="advantage" + suffix, value_target="value_target" + suffix)
            return estimator

        # one GAE per value head; with two heads PPO sees the sum of the advantages
        self.advantages = [gae(s) for s in self.suffixes]
        from .policy import loss_critic

        # a critic sharing the actor's trunk runs only its head in the loss (the trunk once)
        self.loss_critic = loss_critic(actor, critic)
        self.loss = ClipPPOLoss(
            actor,
            self.loss_critic if value_heads == 1 else None,
            clip_epsilon=ppo.clip_epsilon,
            entropy_coeff=ppo.entropy_coeff,
            critic_coeff=ppo.critic_coeff if value_heads == 1 else None,
            normalize_advantage=True,
            loss_critic_type="smooth_l1",
        )
        # the loss without its critic, for updates whose critic pass is the advantages' (one
        # minibatch of the whole batch: :meth:`reuses_critic_pass`); same actor, same parameters
        self.trunk = None  # a GRU policy's shared trunk, run once by such updates
        head = None  # the actor that loss runs: the whole light actor, or the GRU policy's head
        if value_heads == 1 and self.fast_values and not recurrent and self.loss_critic is critic:
            head = actor
        elif value_heads == 1 and self.fast_values and recurrent and self.loss_critic is not critic:
            from .policy import actor_head

            trunk, trunk_head = actor_head(actor)
            if trunk is not None and _single_gru(trunk) is not None:
                self.trunk, head = trunk, trunk_head
        self.actor_loss = None if head is None else ClipPPOLoss(
            head, None, clip_epsilon=ppo.clip_epsilon, entropy_coeff=ppo.entropy_coeff, critic_coeff=None,
            normalize_advantage=True)
        self._compile(ppo.compile, compile_backend)
        self.params = list(self.loss.parameters())
        if value_heads == 2:
            self.params += list(critic.parameters())
        # fused: one kernel for every parameter's Adam step instead of a loop over tensors
        self.optimizer = torch.optim.Adam(self.params, lr=ppo.lr, eps=1e-6, fused=True)
        # the keys one minibatch needs: the loss's inputs, the advantages and value targets
        self.minibatch_keys = sorted(set(self.loss.in_keys) | set(critic.in_keys)
                                     | {"advantage"} | {"value_target" + s for s in self.suffixes},
                                     key=str)
        from .policy import TRUNK_KEYS

        # the keys an update reads from a collected batch, the only ones copied to the device: a
        # rollout also carries captions, episode statistics and acting-time logits (light policy:
        # 1.6 kB a step, of which the update reads 0.9). The trunk's outputs are recomputed.
        self.batch_keys = sorted((set(self.loss.in_keys) | set(critic.in_keys) | {("next", k) for k in critic.in_keys}
                                  | {("next", "reward" + s) for s in self.suffixes}
                                  | {("next", "done"), ("next", "terminated"), ("next", "truncated")})
                                 - set(TRUNK_KEYS), key=str)
        # GRU policies: the recurrent state of every step is in the rollout, but the update reads
        # only each row's first one (a recurrent pass starts from it and restarts from zeros at
        # every reset; recurrent_values recomputes the next states): only those cross to the device
        self.start_state_keys: List[str] = []
        if self.recurrent and self.fast_values:
            from torchrl.modules import GRUModule, LSTMModule

            cores = [m for net in (actor, critic) for m in net.modules() if isinstance(m, (GRUModule, LSTMModule))]
            if all(isinstance(m, GRUModule) for m in cores):
                self.start_state_keys = sorted({m.in_keys[1] for m in cores}, key=str)
        self._staging = None  # a pinned host copy of the last batch shape, reused (CUDA only)
        self._staged = None  # the CUDA event after which the staging copy may be overwritten

    def _compile(self, mode: str, backend: str) -> None:
        """What each stage calls: the modules, or their ``torch.compile`` (``mode`` not ``"off"``)."""
        self.compile_mode = mode
        self.run_loss, self.run_actor_loss, self.run_critic, self.run_critic_head = (
            self.loss, self.actor_loss, self.critic, self.loss_critic)
        if mode == "off":
            return

        def compiled(module):
            options = {} if mode == "default" else {"mode": mode}
            return None if module is None else torch.compile(module, backend=backend, **options)

        self.run_actor_loss = compiled(self.actor_loss)
        if self.recurrent:  # the heads only: the GRU's pass splits trajectories at resets
            self.run_critic_head = compiled(self.loss_critic) if self.loss_critic is not self.critic else self.critic
        else:
            self.run_loss, self.run_critic = compiled(self.loss), compiled(self.critic)

    def _mark_step(self) -> None:
        """With CUDA graphs (``reduce-overhead``): a new step begins, the last one's outputs are
        no longer read (they would otherwise be kept alive, or overwritten under the reader)."""
        if self.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()

    # ------------------------------------------------------------------ stages
    def to_device(self, batch: TensorDictBase) -> TensorDictBase:
        """The keys of ``batch`` an update reads (:attr:`batch_keys`), on the learner's device;
        ``batch`` itself when it is there already.

        On CUDA they go through a pinned host buffer kept from one update to the next and are
        copied without blocking: pinning a fresh batch each time (``pin_memory()``) allocated
        page-locked memory per tensor and cost more than the copy (GRU policy, 16k frames on an
        H200: 51 % of the update).
        """
        if batch.device == self.device or (self.device.type == "cpu" and batch.device is None):
            return batch
        batch = self.pack_states(batch.select(*self.batch_keys, strict=False))
        if self.device.type != "cuda":
            return self.unpack_states(batch.to(self.device))
        staging = self._staging
        if staging is None or staging.batch_size != batch.batch_size or set(staging.keys(True, True)) != set(
                batch.keys(True, True)):
            staging = self._staging = batch.clone().pin_memory()
        else:
            if self._staged is not None:
                self._staged.synchronize()  # the previous update's copy has left the buffer
            staging.update_(batch)
        out = staging.to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record(torch.cuda.current_stream(self.device))
        return self.unpack_states(out)

    def pack_states(self, batch: TensorDictBase) -> TensorDictBase:
        """``batch`` [N, T] for the trip to the device: without GRU policies, itself; with them, a
        TensorDict [N] of the batch without its recurrent states (``"steps"``) and each row's first
        state (``"starts"``, [N, 1]). GRU states are 70 % of a rollout step's bytes."""
        if not self.start_state_keys:
            return batch
        from tensordict import TensorDict

        starts = TensorDict({k: batch.get(k)[:, :1] for k in self.start_state_keys}, batch_size=[batch.shape[0], 1])
        drop = self.start_state_keys + [("next", k) for k in self.start_state_keys]
        steps = batch.exclude(*drop)
        return TensorDict({"steps": steps, "starts": starts}, batch_size=batch.shape[:1], device=batch.device)

    def unpack_states(self, packed: TensorDictBase) -> TensorDictBase:
        """The batch [N, T] :meth:`pack_states` packed, where it now is: each recurrent state is
        the row's first one at step 0 and zeros after it (never read: the recurrent pass starts
        from step 0's and resets to zeros), the next states zeros (recomputed by the values)."""
        if not self.start_state_keys:
            return packed
        batch, starts = packed.get("steps"), packed.get("starts")
        for key in self.start_state_keys:
            first = starts.get(key)
            state = first.new_zeros((first.shape[0], batch.shape[1]) + first.shape[2:])
            state[:, :1] = first
            batch.set(key, state)
            batch.set(("next", key), torch.zeros_like(state))
        return batch

    def reuses_critic_pass(self, batch: TensorDictBase) -> bool:
        """Whether an update of ``batch`` is one minibatch of the whole batch, whose critic pass
        can give the advantages their values (see the module's docstring)."""
        if self.actor_loss is None or self.ppo.ppo_epochs != 1:
            return False
        if self.recurrent:  # minibatches of whole trajectories
            return max(1, self.ppo.minibatch_size // batch.shape[1]) >= batch.shape[0]
        return self.ppo.minibatch_size >= batch.numel()

    def compute_advantages(self, batch: TensorDictBase, keep_graph: bool = False) -> Optional[torch.Tensor]:
        """Values, advantages and value targets, written into ``batch``. With ``keep_graph``
        (only where :meth:`reuses_critic_pass`) the critic runs with gradients and its values of the batch's
        observations are returned with their graph, ``[N * T, 1]`` (``[N, T, 1]`` for a GRU
        policy, whose trunk outputs stay in ``batch`` with theirs), for the critic loss."""
        kept = None
        if keep_graph and self.trunk is not None:
            with self.clock("forward"):
                # the trunk's outputs stay in the batch with their graph: the loss's head reads them
                self.trunk(batch)
                out = self.run_critic_head(batch.select("core"))
                kept = out.get(self.value_keys[0])
            with self.clock("gae"):
                _write_recurrent_values(self.critic, batch, self.value_keys, out, batch.get("core"))
        elif keep_graph:
            with self.clock("forward"):
                kept = feedforward_values(self.run_critic, batch, self.value_keys, self._pad_multiple(batch))
        with torch.no_grad(), self.clock("gae"):
            if self.fast_values and not keep_graph:
                if self.recurrent:
                    recurrent_values(self.critic, batch, self.value_keys)
                else:
                    feedforward_values(self.run_critic, batch, self.value_keys, self._pad_multiple(batch))
            for estimator in self.advantages:
                estimator(batch)
            if self.value_heads == 2:
                batch.set("advantage", batch.get("advantage_ext") + batch.get("advantage_int"))
        return kept

    def _pad_multiple(self, batch: TensorDictBase) -> int:
        """How :func:`feedforward_values` pads the next observations: to whole rows of games when
        the critic is compiled (from N to N + its episode ends: one or two shapes a run), else not."""
        return batch.shape[0] if self.compile_mode != "off" else 1

    def update(self, batch: TensorDictBase) -> Dict[str, float]:
        """One PPO update (``ppo_epochs`` passes of minibatches) on ``batch`` ``[N, T]``; returns
        the mean of each statistic as ``train/<name>``. Advantages are written into the batch
        (the device's copy of it)."""
        clock, ppo = self.clock, self.ppo
        with clock("transfer"):
            batch = self.to_device(batch)
        ctx = contextlib.nullcontext()
        if self.recurrent:
            from torchrl.modules import set_recurrent_mode

            ctx = set_recurrent_mode(True)
        stats: Dict[str, List[torch.Tensor]] = {}
        reuse = self.reuses_critic_pass(batch)
        self._mark_step()
        with ctx:
            values = self.compute_advantages(batch, keep_graph=reuse)
            with clock("minibatch"):
                if self.recurrent:
                    data = batch  # the recurrent core reads its state and resets along each trajectory
                    n_items, per_item = data.shape[0], data.shape[1]
                    mb_items = max(1, ppo.minibatch_size // per_item)  # minibatches of whole trajectories
                else:
                    data = batch.select(*self.minibatch_keys, strict=False).reshape(-1)
                    n_items, mb_items = data.shape[0], min(ppo.minibatch_size, data.shape[0])
            whole = mb_items >= n_items  # one minibatch: the whole batch, in any order
            for _ in range(ppo.ppo_epochs):
                perm = None if whole else torch.randperm(n_items, device=self.device)
                for start in range(0, n_items, mb_items):
                    with clock("minibatch"):
                        minibatch = data if whole else data[perm[start : start + mb_items]]
                    if not reuse:  # a reused pass's values are read by its one minibatch: no new step
                        self._mark_step()
                    with clock("forward"):
                        if reuse:  # the critic's pass was the advantages': only its loss is left
                            losses = self.run_actor_loss(minibatch)
                            losses.set("loss_critic", self._critic_loss({self.value_keys[0]: values}, minibatch))
                        else:
                            losses = self.run_loss(minibatch)
                        if self.value_heads == 2:  # whole critic: no actor pass here
                            values_td = self.critic(minibatch.select(*self.critic.in_keys, strict=False).copy())
                            losses.set("loss_critic", self._critic_loss(values_td, minibatch))
                        total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                    with clock("backward"):
                        self.optimizer.zero_grad(set_to_none=True)
                        total.backward()
                    with clock("optimizer"):
                        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, ppo.max_grad_norm)
                        self.optimizer.step()
                    with clock("stats"):
                        for key in STAT_KEYS[:-1]:
                            if key in losses.keys():
                                stats.setdefault(key, []).append(losses.get(key).detach().float().mean())
                        stats.setdefault("grad_norm", []).append(grad_norm.detach().float())
        with clock("stats"):
            # one read from the device for every statistic of the update
            names = list(stats)
            means = torch.stack([torch.stack(stats[k]).mean() for k in names]).tolist() if names else []
        return {f"train/{k}": v for k, v in zip(names, means)}

    def _critic_loss(self, values, minibatch: TensorDictBase) -> torch.Tensor:
        """Smooth-L1 of each value head's ``values`` (anything with ``.get(value_key)``) against
        its own GAE target, weighted like PPO's (TorchRL's ``ClipPPOLoss`` critic loss)."""
        loss = 0.0
        for suffix in self.suffixes:
            loss = loss + torch.nn.functional.smooth_l1_loss(
                values.get("state_value" + suffix), minibatch.get("value_target" + suffix))
        return self.ppo.critic_coeff * loss
