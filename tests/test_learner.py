"""The learner against a reference: TorchRL's own PPO path as the trainer ran it before the
learner was split out (GAE with its value network over observations and next observations,
ClipPPOLoss on minibatches of the whole batch). Same batch, same minibatch order: the advantages,
the losses and the weights after the update must agree up to float rounding — for the light
policy, the recurrent ONI policy, two value heads and batches gathered from several workers."""
import copy

import pytest
import torch
from tensordict import TensorDict

from torchrl_oni.train import TrainHook
from torchrl_oni.train.config import PPOConfig, TrainConfig
from torchrl_oni.train.learner import PPOLearner, feedforward_values, recurrent_values, rollout_batch
from torchrl_oni.train.ppo import Trainer
from torchrl_oni.train.timing import LOSS_STAGES, StageClock


def _rollout(arch="light", games=6, steps=24, max_episode_steps=10, seed=0, value_heads=1):
    """A real batch [games, steps] with terminations and truncations inside it."""
    return rollout_batch(arch, games, steps, max_episode_steps, seed, value_heads)


def _reference_update(actor, critic, batch, ppo: PPOConfig, recurrent=False, value_heads=1, seed=0):
    """The trainer's update before this change, written out: TorchRL's GAE with the value
    network, a float per minibatch and statistic. Returns (batch with advantages, stats)."""
    import contextlib

    import numpy as np
    from torchrl.modules import set_recurrent_mode
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    suffixes = [""] if value_heads == 1 else ["_ext", "_int"]
    estimators = []
    for s in suffixes:
        g = GAE(gamma=ppo.gamma, lmbda=ppo.gae_lambda, value_network=critic, average_gae=False,
                deactivate_vmap=recurrent)
        if s:
            g.set_keys(reward="reward" + s, value="state_value" + s, advantage="advantage" + s,
                       value_target="value_target" + s)
        estimators.append(g)
    loss = ClipPPOLoss(actor, critic if value_heads == 1 else None, clip_epsilon=ppo.clip_epsilon,
                       entropy_coeff=ppo.entropy_coeff, critic_coeff=ppo.critic_coeff if value_heads == 1 else None,
                       normalize_advantage=True, loss_critic_type="smooth_l1")
    params = list(loss.parameters()) + (list(critic.parameters()) if value_heads == 2 else [])
    opt = torch.optim.Adam(params, lr=ppo.lr, eps=1e-6)
    stats = {}
    ctx = set_recurrent_mode(True) if recurrent else contextlib.nullcontext()
    torch.manual_seed(seed)  # as the learner's caller seeds: before the advantages
    with ctx:
        with torch.no_grad():
            for g in estimators:
                g(batch)
            if value_heads == 2:
                batch.set("advantage", batch["advantage_ext"] + batch["advantage_int"])
        if recurrent:
            flat, n_items = batch, batch.shape[0]
            mb = max(1, ppo.minibatch_size // batch.shape[1])
        else:
            flat = batch.reshape(-1)
            n_items, mb = flat.shape[0], min(ppo.minibatch_size, flat.shape[0])
        for _ in range(ppo.ppo_epochs):
            perm = torch.randperm(n_items)
            for start in range(0, n_items, mb):
                minibatch = flat[perm[start:start + mb]]
                losses = loss(minibatch)
                if value_heads == 2:
                    values = critic(minibatch.select(*critic.in_keys, strict=False).copy())
                    lc = sum(torch.nn.functional.smooth_l1_loss(values["state_value" + s], minibatch["value_target" + s])
                             for s in suffixes)
                    losses.set("loss_critic", ppo.critic_coeff * lc)
                total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                opt.zero_grad(set_to_none=True)
                total.backward()
                gn = torch.nn.utils.clip_grad_norm_(params, ppo.max_grad_norm)
                opt.step()
                for k in ("loss_objective", "loss_critic", "loss_entropy", "entropy", "kl_approx", "clip_fraction"):
                    if k in losses.keys():
                        stats.setdefault(k, []).append(float(losses[k].detach().mean()))
                stats.setdefault("grad_norm", []).append(float(gn))
    return batch, {f"train/{k}": float(np.mean(v)) for k, v in stats.items()}


def _compare(arch="light", value_heads=1, minibatch_size=64, ppo_epochs=2, parts=1, weights_atol=1e-5,
             packed=False):
    actor, critic, batch = _rollout(arch, value_heads=value_heads)
    recurrent = arch != "light"
    ppo = PPOConfig(minibatch_size=minibatch_size, ppo_epochs=ppo_epochs, lr=1e-3)
    ref_actor, ref_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    ref_batch, ref_stats = _reference_update(ref_actor, ref_critic, batch.clone(), ppo, recurrent, value_heads)
    learner = PPOLearner(actor, critic, ppo, torch.device("cpu"), recurrent=recurrent, value_heads=value_heads)
    # the gathered path: the same games handed over as `parts` workers' batches, joined
    mine = torch.cat(batch.clone().split(batch.shape[0] // parts, 0), 0) if parts > 1 else batch.clone()
    # only the keys the learner copies to its device (the reference has the whole rollout)
    mine = mine.select(*learner.batch_keys, strict=False)
    assert set(batch.keys(True, True)) - set(mine.keys(True, True)), "the rollout has keys the update never reads"
    if packed:  # the trip to a device: only each row's first recurrent state crosses
        trip = learner.pack_states(mine)
        assert set(trip.keys()) == {"steps", "starts"} and trip.get("starts").shape == (mine.shape[0], 1)
        mine = learner.unpack_states(trip)
        state = mine.get("recurrent_state")
        assert not state[:, 1:].any() and not mine.get(("next", "recurrent_state")).any()
        torch.testing.assert_close(state[:, 0], batch.get("recurrent_state")[:, 0], rtol=0, atol=0)
        assert batch.get("recurrent_state")[:, 1:].any()  # the rollout's own states were not zeros
    torch.testing.assert_close(mine["action"], batch["action"])
    torch.manual_seed(0)
    stats = learner.update(mine)
    keys = ["advantage"] + [f"value_target{s}" for s in ([""] if value_heads == 1 else ["_ext", "_int"])]
    for key in keys:
        torch.testing.assert_close(mine[key], ref_batch[key], rtol=1e-4, atol=1e-5, msg=f"{key} differs")
    assert stats.keys() == ref_stats.keys()
    for key in stats:
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-3, abs=1e-5), key
    mine_params = dict(actor.named_parameters()) | {f"critic.{k}": v for k, v in critic.named_parameters()}
    ref_params = dict(ref_actor.named_parameters()) | {f"critic.{k}": v for k, v in ref_critic.named_parameters()}
    for name, p in mine_params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=weights_atol, msg=f"weights {name} differ")
    return batch, mine


def test_feedforward_values_equal_torchrl_gae_values_across_resets():
    actor, critic, batch = _rollout("light", max_episode_steps=7)
    done = batch["next", "done"]
    assert done.any() and batch["next", "truncated"].any(), "the batch must cross episode ends"
    from torchrl.objectives.value import GAE

    ref = batch.clone()
    with torch.no_grad():
        GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=False)(ref)
        mine = batch.clone()
        feedforward_values(critic, mine, ["state_value"])
    torch.testing.assert_close(mine["state_value"], ref["state_value"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine["next", "state_value"], ref["next", "state_value"], rtol=1e-5, atol=1e-6)
    # the shortcut matters: at episode ends the next value is not the following step's value
    shifted = mine["state_value"][:, 1:]
    ends = done[:, :-1].squeeze(-1)
    assert not torch.allclose(mine["next", "state_value"][:, :-1][ends], shifted[ends])


def test_recurrent_values_equal_torchrl_gae_values_across_resets():
    """The GRU critic's values from one pass equal TorchRL's two-sequence GAE values when the
    weights are the acting ones, episode ends (terminal observations, resets) included."""
    from torchrl.modules import set_recurrent_mode
    from torchrl.objectives.value import GAE

    actor, critic, batch = _rollout("oni", games=4, steps=20, max_episode_steps=7)
    assert batch["next", "done"].any() and batch["is_init"][:, 1:].any()
    ref = batch.clone()
    with torch.no_grad(), set_recurrent_mode(True):
        GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=False, deactivate_vmap=True)(ref)
        mine = batch.clone()
        recurrent_values(critic, mine, ["state_value"])
    torch.testing.assert_close(mine["state_value"], ref["state_value"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mine["next", "state_value"], ref["next", "state_value"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_heads", [1, 2])
def test_light_update_equals_torchrl_reference(value_heads):
    _compare("light", value_heads=value_heads)


def test_gathered_batches_update_like_one_batch():
    """Three workers' batches joined into one update give the reference's advantages, losses and
    weights for the same frames (--frames-per-update)."""
    _compare("light", parts=3, minibatch_size=48, ppo_epochs=1)


@pytest.mark.parametrize("parts", [1, 3])
def test_one_minibatch_of_the_whole_batch_reuses_the_critic_pass_and_equals_torchrl_reference(parts):
    """The default shape of an update (one epoch, one minibatch of the whole batch): the
    advantages' values come from the loss's own critic pass, so the critic runs once per update
    where the reference runs it twice (GAE, then the loss); advantages, losses and weights are
    the reference's."""
    calls = []
    original = _rollout

    def counted(*args, **kwargs):
        actor, critic, batch = original(*args, **kwargs)
        critic.register_forward_hook(lambda module, inputs, output: calls.append(1))
        return actor, critic, batch

    globals()["_rollout"] = counted
    try:
        _compare("light", minibatch_size=6 * 24, ppo_epochs=1, parts=parts)
    finally:
        globals()["_rollout"] = original
    # the reference's copy of the critic carries the hook too: it runs twice (GAE, loss), ours once
    assert len(calls) == 3


@pytest.mark.slow
def test_a_gru_update_of_one_minibatch_runs_the_trunk_once():
    """GRU policy, one minibatch of whole trajectories: the encoder runs over the batch once (the
    trunk's pass, kept for the loss's heads) plus once over the few next observations GAE needs,
    instead of once for GAE's values and once more for the loss; the update is the reference's
    (test_recurrent_update_equals_torchrl_reference takes this path)."""
    actor, critic, batch = _rollout("oni")
    encoder = actor.module[0].module[0].module[0]
    rows = []
    encoder.register_forward_hook(lambda module, inputs, output: rows.append(output["features"].shape[:-1].numel()))
    learner = PPOLearner(actor, critic, PPOConfig(minibatch_size=batch.numel(), ppo_epochs=1), torch.device("cpu"),
                         recurrent=True)
    assert learner.reuses_critic_pass(batch)
    learner.update(batch)
    need = batch.get(("next", "done")).squeeze(-1).clone()
    need[:, -1] = True
    assert rows == [batch.numel(), int(need.sum())]


def test_the_critic_pass_is_reused_only_where_it_is_the_same_pass():
    actor, critic, batch = _rollout("light")
    whole = batch.numel()
    for ppo, value_heads, expected in ((PPOConfig(minibatch_size=whole), 1, True),
                                       (PPOConfig(minibatch_size=whole // 2), 1, False),
                                       (PPOConfig(minibatch_size=whole, ppo_epochs=2), 1, False)):
        learner = PPOLearner(actor, critic, ppo, torch.device("cpu"), value_heads=value_heads)
        assert learner.reuses_critic_pass(batch) is expected, (ppo, value_heads)
    a2, c2, b2 = _rollout("light", value_heads=2)
    assert not PPOLearner(a2, c2, PPOConfig(minibatch_size=whole), torch.device("cpu"),
                          value_heads=2).reuses_critic_pass(b2)
    for arch, expected in (("oni", True), ("oni-lstm", False)):  # an LSTM keeps TorchRL's GAE path
        a3, c3, b3 = _rollout(arch)
        for minibatch, reused in ((whole, expected), (whole // 2, False)):
            learner = PPOLearner(a3, c3, PPOConfig(minibatch_size=minibatch, ppo_epochs=1), torch.device("cpu"),
                                 recurrent=True)
            assert learner.reuses_critic_pass(b3) is reused, (arch, minibatch)
    clock = StageClock()
    learner = PPOLearner(actor, critic, PPOConfig(minibatch_size=whole), torch.device("cpu"), clock=clock)
    learner.update(batch)
    # the critic's pass with gradients is the loss's forward; the recursion alone is GAE's
    assert clock.count("forward") == 2 and clock.count("backward") == 1 and clock.count("gae") == 1


@pytest.mark.slow
def test_recurrent_update_equals_torchrl_reference():
    # one minibatch: Adam's first step is about lr · sign(gradient), so the rounding of a
    # near-zero gradient component (the GRU's threaded backward) would be amplified by later
    # steps; losses and gradient norm are compared tightly, weights to within one step
    lr = 1e-3
    _compare("oni", minibatch_size=6 * 24, ppo_epochs=1, weights_atol=2 * lr)


@pytest.mark.slow
def test_recurrent_update_from_the_first_states_only_equals_torchrl_reference():
    """What crosses to a GPU learner (PPOLearner.pack_states): each row's first GRU state; the
    rest are zeros on arrival. The recurrent pass starts from step 0's state and from the stored
    state at each reset, which is zeros: the update is the reference's."""
    actor, critic, batch = _rollout("oni")
    assert not batch.get("recurrent_state")[batch.get("is_init").squeeze(-1)].any()  # what the equality rests on
    lr = 1e-3
    _compare("oni", minibatch_size=6 * 24, ppo_epochs=1, weights_atol=2 * lr, packed=True)


def test_only_gru_policies_pack_their_states():
    ppo = PPOConfig(minibatch_size=64)
    for arch, recurrent, expected in (("light", False, []), ("oni", True, ["recurrent_state"]),
                                      ("oni-lstm", True, [])):
        actor, critic, batch = _rollout(arch, games=2, steps=8)
        learner = PPOLearner(actor, critic, ppo, torch.device("cpu"), recurrent=recurrent)
        assert learner.start_state_keys == expected, arch
        if not expected:
            assert learner.pack_states(batch) is batch and learner.unpack_states(batch) is batch


def test_stage_clock_covers_the_update():
    actor, critic, batch = _rollout("light")
    clock = StageClock()
    learner = PPOLearner(actor, critic, PPOConfig(minibatch_size=32), torch.device("cpu"), clock=clock)
    learner.update(batch)
    n_minibatches = -(-batch.numel() // 32)
    assert clock.count("forward") == clock.count("backward") == clock.count("optimizer") == n_minibatches
    assert clock.count("gae") == 1 and clock.count("transfer") == 1
    shares = clock.shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    outside = clock.outside_loss_share()
    assert 0 < outside < 1
    assert outside == pytest.approx(1 - sum(shares[s] for s in LOSS_STAGES))


def test_trainer_gathers_batches_per_update(tmp_path):
    from torchrl_oni.train.run_log import read_metrics

    cfg = TrainConfig(frames=4 * 128, workers=2, envs_per_worker=4, rollout=32, frames_per_update=256,
                      minibatch_size=128, logdir=str(tmp_path), progress=False, tensorboard=False)
    hooked = []

    class Shapes(TrainHook):  # a hook: it sees each update's gathered batch once
        stages = ("batch",)

        def on_batch(self, batch, trainer):
            hooked.append(tuple(batch.shape))
            return batch

    trainer = Trainer.from_config(cfg, hooks=[Shapes()])
    seen = []
    original = trainer._ppo_update
    trainer._ppo_update = lambda batch: (seen.append(tuple(batch.shape)), original(batch))[1]
    summary = trainer.train()
    assert summary["frames"] == 512
    assert seen == [(8, 32), (8, 32)], "two workers' batches per update"
    assert hooked == seen, "hooks run once per update, on the gathered batch"
    row = read_metrics(str(tmp_path))[-1]
    assert row["iteration"] == 2
    assert 0 < row["learner/outside_loss_share"] < 1
    assert row["learner/forward_share"] > 0 and row["learner/gae_share"] > 0


def test_frames_per_update_must_be_whole_batches():
    with pytest.raises(ValueError, match="multiple of one batch"):
        TrainConfig(envs_per_worker=4, rollout=32, frames_per_update=200).validate()
    with pytest.raises(ValueError, match="at most --frames"):
        TrainConfig(envs_per_worker=32, rollout=32, frames=10**9, frames_per_update=2**40).validate()
    with pytest.raises(ValueError, match="at most --frames"):
        TrainConfig(envs_per_worker=4, rollout=32, frames=1024, frames_per_update=2048).validate()
    with pytest.raises(ValueError, match="--acting server needs a backend whose workers can reach a policy server"):
        TrainConfig(acting="server", backend="ray").validate()


@pytest.mark.slow
def test_trainer_acts_through_the_policy_server(tmp_path):
    """--acting server: the workers' games are answered by one served copy of the policy, the
    served copy follows the learner's weights, and the run logs how the server batches."""
    from torchrl_oni.train.run_log import read_metrics

    cfg = TrainConfig(frames=6 * 256, workers=2, envs_per_worker=8, rollout=32, acting="server",
                      minibatch_size=256, logdir=str(tmp_path), progress=False, tensorboard=False)
    trainer = Trainer.from_config(cfg)
    summary = trainer.train()
    assert summary["frames"] == 6 * 256
    row = read_metrics(str(tmp_path))[-1]
    assert row["acting/requests"] > 0 and row["acting/mean_batch_games"] >= 8
    served = dict(trainer.workers.server.model.actor.named_parameters())  # holds the weights of the last update
    for name, p in trainer.actor.named_parameters():
        torch.testing.assert_close(served[name].cpu(), p.detach().cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("arch", ["light", "oni"])
def test_cuda_update_equals_cpu_update(arch):
    """The learner on CUDA (pinned, non-blocking transfer; statistics read once) computes what it
    computes on the CPU, from a CPU batch as the trainer hands it over."""
    actor, critic, batch = _rollout(arch)
    ppo = PPOConfig(minibatch_size=batch.numel(), ppo_epochs=1, lr=1e-3)
    recurrent = arch != "light"
    # copied together: the GRU policy's actor and critic share their trunk (one pass an update)
    cpu = PPOLearner(*copy.deepcopy((actor, critic)), ppo, torch.device("cpu"), recurrent=recurrent)
    gpu = PPOLearner(*[m.cuda() for m in copy.deepcopy((actor, critic))], ppo, torch.device("cuda"),
                     recurrent=recurrent)
    assert cpu.reuses_critic_pass(batch) and gpu.reuses_critic_pass(batch)
    # two updates in a row: the second batch goes through the pinned buffer the first one left
    other = _rollout(arch, seed=1)[2]
    for data in (batch, other):
        a, b = data.clone(), data.clone()
        stats_cpu, stats_gpu = cpu.update(a), gpu.update(b)
        for key in stats_cpu:
            assert stats_gpu[key] == pytest.approx(stats_cpu[key], rel=2e-3, abs=1e-4), key
        for p, q in zip(cpu.params, gpu.params):
            torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-3, atol=4 * ppo.lr)
    assert gpu._staging is not None and all(t.is_pinned() for t in gpu._staging.values(True, True))


def test_acting_copy_stores_no_trunk_outputs():
    """Workers act with a copy whose rollouts leave out the recurrent trunk's outputs (5.2 kB a
    step); its weights have the actor's names (weight sync), and the learner updates on such a
    rollout as on a full one."""
    from tensordict import TensorDict

    from torchrl_oni.train.policy import TRUNK_KEYS, acting_copy

    actor, critic, batch = _rollout("oni", games=4, steps=8)
    acting = acting_copy(actor)
    assert set(TensorDict.from_module(acting).keys(True, True)) == set(TensorDict.from_module(actor).keys(True, True))
    assert not set(TRUNK_KEYS) & set(acting.out_keys) and set(TRUNK_KEYS) <= set(actor.out_keys)
    with torch.no_grad():
        out = acting(batch[:, 0].select(*actor.in_keys).clone())
    assert not set(TRUNK_KEYS) & set(out.keys())
    assert all(k in actor.out_keys for k in acting.out_keys) and set(TRUNK_KEYS) <= set(actor(out.clone()).keys())
    light, _, _ = _rollout("light", games=2, steps=2)
    assert acting_copy(light).out_keys == light.out_keys  # nothing to leave out
