"""The in-place rollout (torchrl_oni/train/_rollout.py) against TorchRL's own ``Collector``: the same
batches, leaf by leaf, and the same carrier after each, on the fast path and on every fallback."""
import os
import warnings

import pytest
import torch
from tensordict.nn import InteractionType
from torchrl.collectors import Collector
from torchrl.envs import InitTracker, TransformedEnv

from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.train._rollout import NLERolloutCollector
from torchrl_oni.train.policy import ActingActor, acting_copy, make_actor_critic

GAMES, STEPS, BATCHES = 3, 8, 5


def _env(seed=3, screens=False, transform=False, together=False):
    env = NLEBatchEnv("score", num_envs=GAMES, seed=seed, task_kwargs={"max_episode_steps": 40}, screens=screens)
    for i, game in enumerate(env.games):  # the games end at different steps: partial resets inside a batch
        game._max_episode_steps = 2 * STEPS if together else 13 + 7 * i
    return TransformedEnv(env, InitTracker()) if transform else env


def _run(cls, *, batches=BATCHES, seed=0, policy="acting", exploration_type=None, patch=None, make_env=None,
         **env_kwargs):
    """``batches`` batches of ``cls`` and the carrier after each; the collector."""
    env = _env(**env_kwargs) if make_env is None else make_env()
    torch.manual_seed(seed)
    actor = make_actor_critic(env)[0]
    if policy == "acting":
        actor = acting_copy(actor)
    elif policy != "modules":  # a policy server's client
        actor = policy
    kw = {} if exploration_type is None else {"exploration_type": exploration_type}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchRL's advice on options this test leaves alone
        collector = cls(env, actor, frames_per_batch=GAMES * STEPS, total_frames=-1, device="cpu",
                        storing_device="cpu", split_trajs=False, **kw)
    if patch is not None:
        patch(collector)
    torch.manual_seed(seed + 1)
    out = []
    try:
        for batch in collector:
            out.append((batch.clone(), collector._carrier.clone()))
            if len(out) == batches:
                break
    finally:
        collector.shutdown()
    return out, collector


def _assert_same(a, b, what):
    keys = set(a.keys(True, True))
    assert keys == set(b.keys(True, True)), f"{what}: keys differ: {keys ^ set(b.keys(True, True))}"
    for key in keys:
        x, y = a.get(key), b.get(key)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{what} {key}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        assert torch.equal(x, y), f"{what} {key}: values differ"


def _assert_close_runs(mine, torchrl, exact):
    """``_assert_same_runs``, but the network's floats may round differently in a forward of fewer
    games (``exact=False``); every other leaf is equal."""
    if exact:
        return _assert_same_runs(mine, torchrl)
    assert len(mine) == len(torchrl) == BATCHES
    for i, ((batch, carrier), (batch_t, carrier_t)) in enumerate(zip(mine, torchrl)):
        for a, b, what in ((batch, batch_t, f"batch {i}"), (carrier, carrier_t, f"carrier after batch {i}")):
            assert set(a.keys(True, True)) == set(b.keys(True, True)), what
            for key in a.keys(True, True):
                x, y = a.get(key), b.get(key)
                if x.is_floating_point() and key != ("next", "reward"):
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {key}: {m}")
                else:
                    assert x.dtype == y.dtype and torch.equal(x, y), f"{what} {key}: values differ"


def _assert_same_runs(mine, torchrl):
    assert len(mine) == len(torchrl) == BATCHES
    for i, ((batch, carrier), (batch_t, carrier_t)) in enumerate(zip(mine, torchrl)):
        assert batch.batch_size == (GAMES, STEPS)
        _assert_same(batch, batch_t, f"batch {i}")
        _assert_same(carrier, carrier_t, f"carrier after batch {i}")


@pytest.mark.parametrize("exploration_type", [None, InteractionType.DETERMINISTIC], ids=["random", "deterministic"])
def test_fast_rollout_equals_torchrl(exploration_type):
    mine, fast = _run(NLERolloutCollector, exploration_type=exploration_type)
    torchrl, _ = _run(Collector, exploration_type=exploration_type)
    assert fast.fast_rollouts == BATCHES
    _assert_same_runs(mine, torchrl)
    batches = torch.cat([b for b, _ in torchrl], 1)
    done = batches["next", "done"].squeeze(-1)
    # what the comparison covered: games ending inside a batch, at different steps, and new trajectories
    assert done.any(1).all() and done.sum() >= 4
    assert batches["collector", "traj_ids"].max() >= GAMES + 2
    ended = done[:, :-1].nonzero()
    after = batches[ended[:, 0], ended[:, 1] + 1]  # the step after an end: a fresh episode
    assert (after["episode", "length"] == 0).all() and not after["done"].any()
    if exploration_type is None:
        assert len(batches["action"].unique()) > 3


@pytest.mark.slow
def test_fast_rollout_with_screens_and_set_truncated_equals_torchrl():
    def truncating(collector):
        collector.set_truncated = True
        collector._set_truncated_keys()

    mine, fast = _run(NLERolloutCollector, screens=True, patch=truncating)
    torchrl, _ = _run(Collector, screens=True, patch=truncating)
    assert fast.fast_rollouts == BATCHES
    assert mine[0][0]["next", "truncated"][:, -1].all() and "tty_chars" in mine[0][0].keys()
    _assert_same_runs(mine, torchrl)


def test_games_ending_together_on_a_batchs_last_step():
    """Every game reset at once: TorchRL keeps the carrier's policy outputs (no padding), as here."""
    mine, fast = _run(NLERolloutCollector, together=True)
    torchrl, _ = _run(Collector, together=True)
    assert fast.fast_rollouts == BATCHES
    assert torchrl[1][0]["next", "done"][:, -1].all() and torchrl[1][1]["logits"].abs().sum() > 0
    _assert_same_runs(mine, torchrl)


def test_the_fast_path_does_not_call_torchrls_rollout(monkeypatch):
    def refused(self):
        raise AssertionError("TorchRL's rollout was called")

    monkeypatch.setattr(Collector, "rollout", refused)
    mine, fast = _run(NLERolloutCollector, batches=2)
    assert fast.fast_rollouts == 2 and len(mine) == 2


@pytest.mark.parametrize("case", [pytest.param("transformed-env", marks=pytest.mark.slow), "no-plain-step",
                                  "random-frames", "reset-at-each-iter"])
def test_fallbacks_take_torchrls_path_and_equal_it(case):
    kw = dict(transform=True) if case == "transformed-env" else dict(policy="modules") if case == "no-plain-step" else {}
    patch = {  # random-frames: the first batch's actions are random (init_random_frames)
        "random-frames": lambda collector: setattr(collector, "init_random_frames", GAMES * STEPS),
        "reset-at-each-iter": lambda collector: setattr(collector, "reset_at_each_iter", True),
    }.get(case)
    mine, fast = _run(NLERolloutCollector, patch=patch, **kw)
    torchrl, plain = _run(Collector, patch=patch, **kw)
    expected_fast = BATCHES - 1 if case == "random-frames" else 0
    assert fast.fast_rollouts == expected_fast
    if case == "no-plain-step":
        assert not isinstance(fast._wrapped_policy, ActingActor)
    _assert_same_runs(mine, torchrl)


def test_paths_taking_turns_continue_each_other():
    """Rollouts 0, 2 and 4 on TorchRL's path, 1 and 3 in place: the carrier each leaves is the other's start."""
    def alternating(collector):
        plan = collector._fast_plan
        calls = []

        def every_other():
            calls.append(None)
            return plan() if len(calls) % 2 == 0 else None

        collector._fast_plan = every_other

    mine, fast = _run(NLERolloutCollector, patch=alternating)
    torchrl, _ = _run(Collector)
    assert fast.fast_rollouts == 2
    _assert_same_runs(mine, torchrl)


@pytest.mark.slow
@pytest.mark.parametrize("acting,workers,splits", [("own", 2, 1), ("served", 1, 1), ("served", 1, 3)])
def test_local_workers_run_the_fast_rollout(acting, workers, splits):
    import contextlib

    from torchrl_oni.train.acting import PolicyServer
    from torchrl_oni.train.config import TrainConfig
    from torchrl_oni.train.distributed import LocalEnvCollector, make_local_collector
    from torchrl_oni.train.env_factory import make_env_factory

    cfg = TrainConfig(workers=workers, envs_per_worker=GAMES, rollout=STEPS).resolved()
    factories = [make_env_factory(cfg, w) for w in range(workers)]
    env = factories[0]()
    actor = make_actor_critic(env)[0]
    env.close()
    batches = 3 * workers
    with contextlib.ExitStack() as stack:
        kw = {}
        if acting == "served":
            server = stack.enter_context(PolicyServer(actor, device="cpu", num_workers=workers, example=factories[0],
                                                      splits=splits))
            kw["worker_policies"] = server.worker_policies()
        collector = make_local_collector(factories, acting_copy(actor), frames_per_batch=GAMES * STEPS,
                                         total_frames=batches * GAMES * STEPS, **kw)
        stack.callback(collector.shutdown)
        assert isinstance(collector, LocalEnvCollector) and collector.collector_class is NLERolloutCollector
        got = list(collector)
        assert [tuple(b.batch_size) for b in got] == [(GAMES, STEPS)] * batches
        assert all(b["next", "episode", "length"].max() > 0 for b in got)
        assert all(n > 0 for n in collector.get_distant_attr("fast_rollouts"))


@pytest.mark.slow
def test_collector_throughput_benchmark_smoke():
    from helpers import BENCH, bench_json

    result, table = bench_json([BENCH / "collector_throughput.py", "--seconds", "1.5", "--envs", "2", "--rollout",
                                "4", "--rounds", "1", "--baseline-code", BENCH.parent])
    assert result["collectors"] == {"torchrl": "Collector", "fast": "NLERolloutCollector",
                                    "baseline-code": "NLERolloutCollector"}
    assert all(result["fps"][row] > 0 for row in result["collectors"]) and result["fast_over_torchrl"] > 0
    assert result["fast_over_baseline_code"] > 0 and "NLERolloutCollector" in table


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--concurrent pins two rows to two cores")
def test_collector_throughput_runs_both_checkouts_at_once_on_a_core_each():
    """--concurrent: this code and --baseline-code measured at the same moments, each pinned to a
    core of its own, the cores swapped every round; the ratio is read round by round. The baseline
    plays its own number of games (--baseline-envs: a default that changed)."""
    from helpers import BENCH, bench_json

    result, table = bench_json([BENCH / "collector_throughput.py", "--seconds", "3", "--envs", "2", "--rollout",
                                "4", "--rounds", "2", "--concurrent", "--baseline-code", BENCH.parent,
                                "--baseline-envs", "3"])
    assert result["games"] == {"fast": 2, "baseline-code": 3} and result["baseline_envs"] == 3
    a, b = sorted(os.sched_getaffinity(0))[:2]
    assert result["concurrent"] and result["rounds_cores"] == [[a, b], [b, a]]
    assert result["collectors"] == {"fast": "NLERolloutCollector", "baseline-code": "NLERolloutCollector"}
    ratios = [f / g for f, g in zip(result["rounds_fps"]["fast"], result["rounds_fps"]["baseline-code"])]
    assert result["fast_over_baseline_code_rounds"] == pytest.approx(ratios, abs=2e-3)
    assert result["fast_over_baseline_code"] == pytest.approx(sorted(ratios)[0] / 2 + sorted(ratios)[1] / 2, abs=2e-3)
    assert "round by round" in table


def test_collector_throughput_concurrent_needs_two_cores(monkeypatch, capfd):
    from helpers import BENCH, script_exit

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    code, err = script_exit(BENCH / "collector_throughput.py", ["--concurrent", "--baseline-code", BENCH.parent], capfd)
    assert code == 2 and "needs two cores" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_collector_throughput_serves_the_recurrent_policy_smoke():
    """--arch oni --acting server: the rows' workers ask a policy server thread; the in-place row
    takes the in-place path with InitTracker and the primed state (tests above: the same batches)."""
    from helpers import BENCH, bench_json

    result, table = bench_json([BENCH / "collector_throughput.py", "--seconds", "1.5", "--envs", "2", "--rollout",
                                "4", "--rounds", "1", "--arch", "oni", "--acting", "server"])
    assert (result["arch"], result["acting"]) == ("oni", "server")
    assert result["in_place_rollouts"]["fast"] > 0 and not result["in_place_rollouts"]["torchrl"]
    assert all(v > 0 for v in result["fps"].values()) and "acting in a policy server thread" in table


@pytest.mark.slow
def test_collector_throughput_sweeps_games_per_worker():
    from helpers import BENCH, bench_json

    result, table = bench_json([BENCH / "collector_throughput.py", "--seconds", "1.5", "--sweep-envs", "2", "4",
                                "--rollout", "4", "--rounds", "1"])
    assert result["sweep_envs"] == [2, 4] and result["collector"] == "NLERolloutCollector"
    assert result["vs_first"]["2"] == 1.0 and result["fps"]["4"] > 0 and result["fastest"] in (2, 4)
    assert "games" in table and "vs K=2" in table


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--concurrent pins two rows to two cores")
def test_collector_throughput_sweeps_two_numbers_of_games_at_once():
    """--sweep-envs K1 K2 --concurrent: the two run at the same moments, each pinned to a core of its
    own, the cores swapped every round; each K's ratio to the first is read round by round."""
    from helpers import BENCH, bench_json

    result, table = bench_json([BENCH / "collector_throughput.py", "--seconds", "3", "--sweep-envs", "2", "4",
                                "--rollout", "4", "--rounds", "2", "--concurrent"])
    a, b = sorted(os.sched_getaffinity(0))[:2]
    assert result["concurrent"] and result["rounds_cores"] == [[a, b], [b, a]]
    ratios = [f / g for f, g in zip(result["rounds_fps"]["4"], result["rounds_fps"]["2"])]
    assert result["vs_first_rounds"]["4"] == pytest.approx(ratios, abs=2e-3)
    assert result["vs_first"]["4"] == pytest.approx(sum(ratios) / 2, abs=2e-3) and result["vs_first"]["2"] == 1.0
    assert result["fastest"] == (4 if sum(ratios) > 2 else 2) and "one core each" in table


@pytest.mark.parametrize("flags,said", [(["--seconds", "0"], "--seconds must be > 0"),
                                        (["--envs", "0"], "--envs must be >= 1"),
                                        (["--sweep-envs", "16", "0"], "every K must be >= 1"),
                                        (["--sweep-envs", "16", "--baseline-code", "."], "leave out --baseline-code"),
                                        (["--sweep-envs", "16", "--acting", "server"], "leave out --arch and --acting"),
                                        (["--baseline-code", "/no/such/dir"], "no torchrl_oni package there"),
                                        (["--concurrent"], "give it"),
                                        (["--baseline-envs", "16"], "give --baseline-code"),
                                        (["--baseline-envs", "0", "--baseline-code", "."], "must be >= 1"),
                                        (["--sweep-envs", "8", "16", "32", "--concurrent"], "give two numbers of games")])
def test_collector_throughput_rejects_bad_input_in_one_line(flags, said, capfd):
    from helpers import BENCH, script_exit

    code, err = script_exit(BENCH / "collector_throughput.py", flags, capfd)
    assert code == 2 and said in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("exploration_type", [None, InteractionType.DETERMINISTIC], ids=["random", "deterministic"])
def test_fast_rollout_through_a_policy_server_equals_torchrl(exploration_type):
    from torchrl_oni.train.acting import PolicyServer

    torch.manual_seed(0)
    env = _env()
    actor = make_actor_critic(env)[0]
    example = env.fake_tensordict()
    env.close()
    runs = {}
    with PolicyServer(actor, device="cpu", num_workers=1, example=example) as server:
        policy, = server.worker_policies()
        for cls in (NLERolloutCollector, Collector):
            runs[cls] = _run(cls, policy=policy, exploration_type=exploration_type)
    (mine, fast), (torchrl, _) = runs[NLERolloutCollector], runs[Collector]
    assert fast.fast_rollouts == BATCHES
    _assert_same_runs(mine, torchrl)


@pytest.mark.parametrize("splits,together", [(1, False), (3, False), (3, True)],
                         ids=["one-group", "groups", "groups-ending-together"])
def test_games_in_groups_through_a_policy_server_equal_torchrl(splits, together):
    """``PolicyServer(splits=)``: a group's games step while the others' actions are computed; greedy
    actions give TorchRL's batches (one request for all games) leaf by leaf, trajectory ids included
    (games of several groups ending at one step take new ids in row order)."""
    from torchrl_oni.train.acting import PolicyServer

    torch.manual_seed(0)
    env = _env()
    actor = make_actor_critic(env)[0]
    example = env.fake_tensordict()
    env.close()
    with PolicyServer(actor, device="cpu", num_workers=1, example=example, splits=splits) as grouped, \
            PolicyServer(actor, device="cpu", num_workers=1, example=example) as whole:
        policy, = grouped.worker_policies()
        assert policy.splits == splits
        deterministic = dict(exploration_type=InteractionType.DETERMINISTIC, together=together)
        mine, fast = _run(NLERolloutCollector, policy=policy, **deterministic)
        requests = grouped.metrics()["acting/requests"]
        torchrl, _ = _run(Collector, policy=whole.worker_policies()[0], **deterministic)
        # TorchRL's own loop with the grouped client: every group asked at once, answers put together
        torchrl_grouped, _ = _run(Collector, policy=policy, **deterministic)
    assert fast.fast_rollouts == BATCHES
    # one request per group and step, and one forward of TorchRL's when the collector is built
    assert requests == (BATCHES * STEPS + 1) * splits
    _assert_close_runs(mine, torchrl, exact=False)
    _assert_close_runs(torchrl_grouped, torchrl, exact=False)
    batches = torch.cat([b for b, _ in mine], 1)
    assert batches["next", "done"].sum() >= 4 and batches["collector", "traj_ids"].max() >= GAMES + 2


@pytest.mark.parametrize("splits", [1, 3], ids=["one-group", "groups"])
def test_a_served_recurrent_policy_fills_the_batch_in_place_as_torchrl_does(splits):
    """ONI's GRU through the policy server on the in-place path: InitTracker's ``is_init`` and the
    primed ``recurrent_state`` (the policy's next state, zeros at a reset) in the batch and the
    carrier are TorchRL's, leaf by leaf, with games ending at different steps and together."""
    from torchrl.envs import Compose

    from torchrl_oni.train.acting import PolicyServer
    from torchrl_oni.train.policy import recurrent_primer

    torch.manual_seed(0)
    probe = _env()
    actor = make_actor_critic(probe, arch="oni")[0]
    probe.close()
    primer = recurrent_primer(actor)

    def recurrent_env(**kw):
        from torchrl.envs import TensorDictPrimer

        env = _env(**kw)
        return TransformedEnv(env, Compose(InitTracker(), TensorDictPrimer(primer.primers, expand_specs=True)))

    example = recurrent_env().fake_tensordict()
    runs = {}
    for together in (False, True):
        with PolicyServer(actor, device="cpu", num_workers=1, example=example, splits=splits) as grouped, \
                PolicyServer(actor, device="cpu", num_workers=1, example=example) as whole:
            for cls, policy in ((NLERolloutCollector, grouped.worker_policies()[0]),
                                (Collector, whole.worker_policies()[0])):
                runs[cls, together] = _run(cls, policy=policy, exploration_type=InteractionType.DETERMINISTIC,
                                           make_env=lambda: recurrent_env(together=together))
        (mine, fast), (torchrl, _) = runs[NLERolloutCollector, together], runs[Collector, together]
        assert fast.fast_rollouts == BATCHES
        _assert_close_runs(mine, torchrl, exact=splits == 1)
        batches = torch.cat([b for b, _ in mine], 1)
        resets = batches["is_init"][:, 1:].squeeze(-1)
        assert resets.any() and batches["next", "recurrent_state"].abs().sum() > 0
        assert (batches["recurrent_state"][:, 1:][resets] == 0).all()  # a new episode starts from zeros
