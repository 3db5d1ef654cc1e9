"""Acting through one policy server (train/acting.py): what the env workers get from the server must
be what their own copy of the policy would have computed — same actions, observations and
log-probabilities, recurrent states right across resets — the server batches the workers'
requests, takes new weights in place, and stops without leaving a thread or a waiting worker behind."""
import copy
import multiprocessing as mp
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, set_exploration_type

from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.train.acting import PolicyServer, PolicyServerGone
from torchrl_oni.train.config import TrainConfig
from torchrl_oni.train.backends import make_collector
from torchrl_oni.train.distributed import ServedPolicyCollector
from torchrl_oni.train.policy import TRUNK_KEYS, ActingActor, PlainStep, acting_copy, make_actor_critic, recurrent_primer
from torchrl_oni.train.env_factory import make_env_factory

GAMES, STEPS = 4, 16


def _actor(arch="light", sharpen=True, seed=0):
    """An actor whose greedy actions depend on the observation (the fresh policy is near uniform)."""
    torch.manual_seed(seed)
    probe = NLEBatchEnv("score", num_envs=1, seed=0)
    actor, _ = make_actor_critic(probe, arch=arch)
    n_actions = int(probe.action_spec.space.n)
    probe.close()
    if sharpen:
        head = [m for m in actor.modules() if isinstance(m, torch.nn.Linear) and m.out_features == n_actions][-1]
        with torch.no_grad():
            head.weight.mul_(100.0)
    return actor


def _factories(actor, workers, max_episode_steps=5000):
    cfg = TrainConfig(workers=workers, envs_per_worker=GAMES, rollout=STEPS, seed=7,
                      max_episode_steps=max_episode_steps)
    primer = recurrent_primer(actor)
    return [make_env_factory(cfg, w, primer.primers if primer is not None else None) for w in range(workers)]


def _observation(factory):
    threads = torch.get_num_threads()
    env = factory()
    try:
        return env.reset()
    finally:
        env.close()
        torch.set_num_threads(threads)


def _first_batches(collector, firsts):
    """Each worker's first batch, recognised by its first observation (workers deliver in any order)."""
    found = {}
    for batch in collector:
        for w, obs in enumerate(firsts):
            if w not in found and torch.equal(batch["crop"][:, 0], obs["crop"]) \
                    and torch.equal(batch["blstats"][:, 0], obs["blstats"]):
                found[w] = batch
        if len(found) == len(firsts):
            break
    assert len(found) == len(firsts), "not every worker delivered its first batch"
    return [found[w] for w in range(len(firsts))]


def _assert_same_batch(local, served, tol=1e-5):
    keys = set(local.keys(True, True)) - {("collector", "traj_ids")} - set(TRUNK_KEYS)
    assert keys == set(served.keys(True, True)) - {("collector", "traj_ids")}
    for key in keys:
        a, b = local.get(key), served.get(key)
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{key}: {m}")
        else:
            assert torch.equal(a, b), key


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("arch,workers,max_episode_steps,device", [
    ("light", 2, 5000, "cpu"), ("oni", 1, 6, "cpu"),
    pytest.param("light", 2, 5000, "cuda", marks=_CUDA), pytest.param("oni", 1, 6, "cuda", marks=_CUDA)])
def test_served_rollout_equals_local_rollout(arch, workers, max_episode_steps, device):
    actor = _actor(arch)
    factories = _factories(actor, workers, max_episode_steps)
    firsts = [_observation(f) for f in factories]
    total = GAMES * STEPS * workers * 50  # an upper bound: iteration stops at the first batch of each worker
    kw = dict(frames_per_batch=GAMES * STEPS, total_frames=total, exploration_type=ExplorationType.DETERMINISTIC)

    # the actor's own modules here; the server's acting copy steps on plain tensors
    collector = make_collector("local", factories, actor, **kw)
    try:
        local = _first_batches(collector, firsts)
    finally:
        collector.shutdown()

    with PolicyServer(actor, device=device, num_workers=workers, example=factories[0]) as server:
        collector = make_collector("local", factories, actor, worker_policies=server.worker_policies(), **kw)
        try:
            assert isinstance(collector, ServedPolicyCollector)
            served = _first_batches(collector, firsts)
            collector.update_policy_weights_(TensorDict.from_module(actor))  # the server has the weights: a no-op
        finally:
            collector.shutdown()
        assert server.metrics()["acting/requests"] >= workers * STEPS

    for a, b in zip(local, served):
        assert len(a["action"].unique()) > 1  # the greedy actions depend on the observations
        assert not set(TRUNK_KEYS) & set(b.keys()), "served rollouts carry no trunk outputs"
        _assert_same_batch(a, b, tol=1e-5 if device == "cpu" else 1e-3)  # CUDA kernels round differently
    if arch == "oni":  # the recurrent state restarts at each reset inside the batch
        assert served[0]["is_init"][:, 1:].any() and served[0]["next", "truncated"].any()
        assert served[0]["next", "recurrent_state"].abs().sum() > 0


def _request(games=GAMES, seed=0):
    env = NLEBatchEnv("score", num_envs=games, seed=seed)
    try:
        return env.reset()
    finally:
        env.close()


def test_update_weights_changes_what_the_server_computes():
    actor = _actor()
    td = _request()
    with PolicyServer(actor, device="cpu", num_workers=1, example=td) as server:
        policy, = server.worker_policies()
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            before = policy(td.clone())
            torch.testing.assert_close(before["logits"], actor(td.clone())["logits"])
            new = copy.deepcopy(actor)
            with torch.no_grad():
                for p in new.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            server.update_weights(TensorDict.from_module(new))
            after = policy(td.clone())
            expected = new(td.clone())
        with pytest.raises(KeyError, match="do not fit"):
            server.update_weights(TensorDict.from_module(_actor("oni")))
    assert not torch.allclose(before["logits"], after["logits"])
    for key in ("logits", "action", "action_log_prob"):
        torch.testing.assert_close(after[key], expected[key])
    for p, q in zip(actor.parameters(), new.parameters()):  # the caller's actors are untouched
        assert not torch.equal(p, q)


def test_the_server_samples_under_the_workers_interaction_type():
    actor = _actor(sharpen=False)  # near uniform: random actions rarely match the greedy ones
    td = _request()
    with PolicyServer(actor, device="cpu", num_workers=1, example=td) as server:
        policy, = server.worker_policies()
        greedy = actor(td.clone())["logits"].argmax(-1)
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            assert all(torch.equal(policy(td.clone())["action"], greedy) for _ in range(3))
        with set_exploration_type(ExplorationType.RANDOM):
            sampled = torch.stack([policy(td.clone())["action"] for _ in range(5)])
    assert not (sampled == greedy).all()


def _published(client) -> bool:
    """Whether a slot client's request is visible to the server: marked ready, or already drained.

    A client flags itself in flight before it marks its slot ready, so waiting on that flag alone
    can release the server while a request is still unpublished (it then gets a forward of its own).
    Draining a slot zeroes its submission time, which the client set before the flag.
    """
    slot = client._slot_id
    return client._in_flight and (client._request_ready[slot] == 1 or client._submitted_at[slot] == 0.0)


def test_requests_that_arrive_together_share_one_forward():
    actor = _actor()
    tds = [_request(seed=s) for s in range(3)]
    with PolicyServer(actor, device="cpu", num_workers=3, example=tds[0]) as server:
        policies = server.worker_policies()
        results = [None] * 3

        def act(i):
            results[i] = policies[i](tds[i].clone())

        with set_exploration_type(ExplorationType.DETERMINISTIC):
            lock = server._server._model_lock
            with lock:  # the server waits for the lock as for a long forward; all three requests queue up
                threads = [threading.Thread(target=act, args=(i,)) for i in range(3)]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 10
                while not all(_published(p.clients[0].client) for p in policies) and time.monotonic() < deadline:
                    time.sleep(0.01)
            for t in threads:
                t.join(10)
            expected = [actor(td.clone()) for td in tds]
        metrics = server.metrics()
    assert metrics["acting/requests"] == 3 and metrics["acting/forwards"] <= 2
    assert metrics["acting/mean_batch_games"] > GAMES
    for got, want in zip(results, expected):  # each worker gets the answer for its own games
        assert torch.equal(got["action"], want["action"])
        torch.testing.assert_close(got["action_log_prob"], want["action_log_prob"])


def test_without_example_the_server_uses_queues():
    actor = _actor("oni")
    primer = recurrent_primer(actor)
    td = _observation(make_env_factory(TrainConfig(envs_per_worker=GAMES), 0, primer.primers))
    with PolicyServer(actor, device="cpu", num_workers=1) as server:
        assert server.transport_kind == "MPTransport"
        policy, = server.worker_policies()
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            got, want = policy(td.clone()), actor(td.clone())
    for key in ("action", "action_log_prob", "logits", ("next", "recurrent_state")):
        torch.testing.assert_close(got[key], want[key])


def _server_threads():
    return [t for t in threading.enumerate() if t.name == "InferenceServer-worker"]


def test_a_request_drained_at_shutdown_is_policy_server_gone_and_other_failures_pass_through():
    """TorchRL answers requests pending at its shutdown with a plain RuntimeError; when that comes
    before the closed mailbox is noticed (a race the CI saw once), the worker must still get
    PolicyServerGone. A failure of the served policy itself keeps its own exception."""
    from types import SimpleNamespace

    from torchrl_oni.train.acting import TORCHRL_SHUTDOWN_MESSAGE, WorkerPolicy

    class Failing:
        def __init__(self, err):
            self.err = err

        def result(self, timeout=None):
            raise self.err

    waiting_worker = SimpleNamespace(request_timeout=None)
    with pytest.raises(PolicyServerGone, match="shut down while this worker's request waited"):
        WorkerPolicy._wait(waiting_worker, Failing(RuntimeError(TORCHRL_SHUTDOWN_MESSAGE)))
    with pytest.raises(RuntimeError, match="mat1 and mat2") as err:
        WorkerPolicy._wait(waiting_worker, Failing(RuntimeError("mat1 and mat2 shapes cannot be multiplied")))
    assert not isinstance(err.value, PolicyServerGone)


def test_shutdown_ends_the_thread_and_waiting_workers_fail_fast():
    actor = _actor()
    td = _request()
    server = PolicyServer(actor, device="cpu", num_workers=1, example=td)
    policy, = server.worker_policies()
    policy(td.clone())
    assert len(_server_threads()) == 1
    errors = []

    def act():
        try:
            policy(td.clone())
        except PolicyServerGone as err:
            errors.append(err)

    with server._server._model_lock:  # a forward that never ends...
        waiting = threading.Thread(target=act)
        waiting.start()
        while not policy.clients[0].client._in_flight:
            time.sleep(0.01)
        t0 = time.monotonic()
        server.shutdown(timeout=0.1)  # ...and the server stops meanwhile
        waiting.join(5)
        assert not waiting.is_alive() and len(errors) == 1 and time.monotonic() - t0 < 2
    server.shutdown()  # twice is fine
    deadline = time.monotonic() + 5
    while _server_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _server_threads()
    with pytest.raises(PolicyServerGone, match="stopped"):
        policy(td.clone())
    with pytest.raises(RuntimeError, match="shut down"):
        server.update_weights(TensorDict.from_module(actor))


def test_a_collector_whose_server_stops_fails_and_leaves_nothing_behind():
    actor = _actor()
    factories = _factories(actor, 1)
    with PolicyServer(actor, device="cpu", num_workers=1, example=factories[0]) as server:
        collector = make_collector("local", factories, actor, frames_per_batch=GAMES * STEPS,
                                   total_frames=GAMES * STEPS * 1000, worker_policies=server.worker_policies())
        try:
            batches = iter(collector)
            next(batches)
            server.shutdown()
            with pytest.raises(RuntimeError, match="worker 0"):  # the worker's PolicyServerGone, reported
                for _ in batches:
                    pass
        finally:
            collector.shutdown()
    assert not mp.active_children() and not _server_threads()


def test_worker_policies_need_the_local_backend():
    with pytest.raises(ValueError, match="needs --backend local"):
        make_collector("ray", [object()], None, frames_per_batch=8, total_frames=8, worker_policies=[object()])


@pytest.mark.parametrize("arch", ["light", "oni"])
@pytest.mark.parametrize("exploration", [ExplorationType.RANDOM, ExplorationType.DETERMINISTIC])
def test_plain_step_equals_the_actor_modules(arch, exploration):
    """The server's plain-tensor step computes what the actor's TensorDict modules compute: the same
    logits, log-probabilities and next recurrent states, the same greedy actions, and under the
    same seed the same sampled actions; recurrent states restart where ``is_init`` is set."""
    from torchrl.modules import set_recurrent_mode

    modules = _actor(arch, sharpen=False)
    actor = acting_copy(modules)
    step = actor.plain_step
    assert isinstance(actor, ActingActor) and isinstance(step, PlainStep)
    td = torch.cat([_request(seed=s) for s in range(4)], 0)  # 16 games
    if arch == "oni":  # states mid-game, and a reset every third game
        td.set("recurrent_state", torch.randn(td.shape[0], 1, 512))
        td.set("is_init", torch.arange(td.shape[0]).remainder(3).eq(0).unsqueeze(-1))
    td = td.select(*actor.in_keys).clone()
    with torch.no_grad(), set_exploration_type(exploration), set_recurrent_mode(False):
        torch.manual_seed(3)
        reference = modules(td.clone())
        torch.manual_seed(3)
        mine = step(td.clone())
        torch.manual_seed(3)
        called = actor(td.clone())  # the acting copy itself: the plain step, written in place
    assert set(mine.keys(True, True)) == set(actor.out_keys)
    assert set(called.keys(True, True)) == set(actor.out_keys) | set(actor.in_keys)
    for key in actor.out_keys:
        a, b = reference.get(key), mine.get(key)
        assert torch.equal(called.get(key), b), key
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
        else:
            assert torch.equal(a, b), key
    if arch == "oni":  # a reset game starts from zeros: its next state is the state from zeros
        fresh = td.clone()
        fresh.set("recurrent_state", torch.zeros_like(td["recurrent_state"]))
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            zeros = step(fresh)
        init = td["is_init"].squeeze(-1)
        torch.testing.assert_close(mine["next", "recurrent_state"][init], zeros["next", "recurrent_state"][init])
        assert not torch.allclose(mine["next", "recurrent_state"][~init], zeros["next", "recurrent_state"][~init])


def test_plain_step_only_for_actors_it_knows():
    """An LSTM core or a network of the user's own is served through its own modules (no plain step)."""
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor

    lstm = acting_copy(_actor("oni-lstm", sharpen=False))
    assert lstm.plain_step is None
    with torch.no_grad():  # it acts through its modules
        td = lstm(_request().set("recurrent_state_h", torch.zeros(GAMES, 1, 512))
                  .set("recurrent_state_c", torch.zeros(GAMES, 1, 512)).set("is_init", torch.ones(GAMES, 1, dtype=torch.bool)))
    assert td["action"].shape == (GAMES,)
    own = ProbabilisticActor(TensorDictModule(torch.nn.Linear(27, 4), in_keys=["blstats"], out_keys=["logits"]),
                             in_keys=["logits"], out_keys=["action"], distribution_class=torch.distributions.Categorical,
                             return_log_prob=True)
    assert PlainStep.build(own) is None
    served = PolicyServer(_actor("light"), device="cpu", num_workers=1, example=_request())
    try:
        assert served.model.actor.plain_step is not None
    finally:
        served.shutdown()


def test_games_in_groups_need_a_layout_they_divide():
    actor = _actor("light")
    with pytest.raises(ValueError, match="more than 1 needs example="):
        PolicyServer(actor, device="cpu", num_workers=1, splits=2)
    with pytest.raises(ValueError, match="splits=2 must divide the 3 games of a worker"):
        PolicyServer(actor, device="cpu", num_workers=1, example=_request(games=3), splits=2)
    with PolicyServer(actor, device="cpu", num_workers=2, example=_request(games=4), splits=2) as server:
        assert server.max_batch_size == 4 and [p.splits for p in server.worker_policies()] == [2, 2]
        assert "splits=2" in repr(server)
