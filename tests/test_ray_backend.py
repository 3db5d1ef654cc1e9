"""``--backend ray``: env workers as Ray actors through TorchRL's ``RayCollector``.

A simulated cluster (``ray.cluster_utils.Cluster``: a head with no CPU for actors and two
worker nodes of one CPU each) stands for a multi-node cluster. The Ray tests are slow (Ray and
its actors take seconds to start): the file takes one and a half to three minutes on two cores.
"""
import copy
import logging
import time

import pytest
import torch
from tensordict import TensorDict

ray = pytest.importorskip("ray")

from helpers import tiny_config  # noqa: E402
from torchrl_oni.envs import NLEBatchEnv  # noqa: E402
from torchrl_oni.train import TrainConfig, Trainer, TrainHook  # noqa: E402
from torchrl_oni.train.backends import check_backend, make_collector  # noqa: E402
from torchrl_oni.train.ray_session import ray_init_kwargs  # noqa: E402
from torchrl_oni.train.policy import make_actor_critic  # noqa: E402
from torchrl_oni.train.env_factory import make_env_factory  # noqa: E402

MB = 2**20


def test_check_backend_and_init_kwargs():
    check_backend("ray", "auto")
    check_backend("ray", "10.0.0.1:6379")
    with pytest.raises(ValueError, match="HOST:PORT"):
        check_backend("ray", "10.0.0.1")
    with pytest.raises(ValueError, match="needs --backend ray"):
        check_backend("local", "auto")
    with pytest.raises(ValueError, match="unknown --backend"):
        check_backend("slurm")
    local = ray_init_kwargs(None, num_cpus=3, object_store_memory=200 * MB)
    assert (local["num_cpus"], local["object_store_memory"], local["include_dashboard"]) == (3, 200 * MB, False)
    assert "num_cpus" not in ray_init_kwargs("auto", num_cpus=3)  # a cluster's sizes are its own
    # nothing listens there: one clear error at once, not ray.init's minutes of retries
    with pytest.raises(ConnectionError, match="nothing answers there"):
        make_collector("ray", [], torch.nn.Linear(1, 1), frames_per_batch=8, total_frames=8,
                       ray_address="127.0.0.1:1")
    assert not ray.is_initialized()


def test_a_ray_without_token_auth_is_refused_in_one_line(monkeypatch, capsys):
    from torchrl_oni.train import ray_session
    from torchrl_oni.train.cli import main

    monkeypatch.setattr(ray_session, "_has_token_auth", lambda: False)
    with pytest.raises(ValueError, match="token authentication"):
        check_backend("ray", "auto")
    with pytest.raises(SystemExit) as stop:
        main(["--backend", "ray", "--workers", "1", "--frames", "1024", "--envs-per-worker", "2"])
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "ray[default]>=2.52" in err[0], err


def _is_loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _listening(processes):
    """``(process name, ip, port)`` of the TCP sockets ``processes`` listen on."""
    import psutil

    out = []
    for proc in processes:
        try:
            out += [(proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def test_a_runs_own_ray_instance_listens_on_loopback_only_with_token_auth():
    """No --ray-address: the Ray instance started for the run (GCS, raylet, workers, agents) has no
    port on another address than the loopback, refuses clients without its token, keeps its
    token file and session folder private, and leaves nothing behind."""
    import os
    import stat

    psutil = pytest.importorskip("psutil")
    from ray._raylet import AuthenticationMode, get_authentication_mode

    from torchrl_oni.train.ray_session import LOCAL_ONLY_ENV, _token_file, cluster_requires_auth

    assert not ray.is_initialized()
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    mine_before = set(_listening([me]))
    env_before = os.environ.get(LOCAL_ONLY_ENV)
    cfg = TrainConfig(workers=1, envs_per_worker=2, rollout=8)
    actor, _ = make_actor_critic(NLEBatchEnv("score", num_envs=1, seed=0))
    collector = make_collector("ray", [make_env_factory(cfg, 0)], actor, frames_per_batch=16, total_frames=16 * 8)
    root = collector.session_root
    try:
        assert next(iter(collector)).shape == (2, 8)  # an env actor is up and playing
        started = [p for p in me.children(recursive=True) if p.pid not in children_before]
        listening = _listening(started) + [row for row in _listening([me]) if row not in mine_before]
        names = {name for name, _, _ in listening}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), listening
        assert all(_is_loopback(ip) for _, ip, _ in listening), [row for row in listening if not _is_loopback(row[1])]
        # token authentication on, the token file and the session folder private
        assert get_authentication_mode() == AuthenticationMode.TOKEN
        token = _token_file()
        assert token is None or stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
        assert cluster_requires_auth(ray.get_runtime_context().gcs_address) is True  # a client without the token
        assert os.environ.get(LOCAL_ONLY_ENV) == env_before  # Ray's processes have it; this one is as it was
    finally:
        collector.shutdown()
    assert not ray.is_initialized() and not os.path.exists(root)


@pytest.fixture
def open_head():
    """A Ray head started without token authentication (``RAY_AUTH_MODE=disabled``), on loopback,
    in a folder of its own; its processes are stopped by that folder (never ``ray stop``, which
    stops every Ray instance of the machine)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    psutil = pytest.importorskip("psutil")
    from torchrl_oni.net import free_port
    from torchrl_oni.train.ray_session import LOCAL_ONLY_ENV

    # a short folder in the usual temp dir, not pytest's: Ray's socket paths must stay under the
    # 107 bytes of a Unix socket's name (pytest-xdist's folders are deeper)
    root = tempfile.mkdtemp(prefix="oni-head-")
    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", **{LOCAL_ONLY_ENV: "0"})
    env.pop("RAY_AUTH_TOKEN", None)
    try:
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                        "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={root}/ray"], env=env, check=True,
                       capture_output=True, timeout=120)
        yield f"127.0.0.1:{port}"
    finally:
        for proc in psutil.process_iter(["cmdline"]):
            if any(root in part for part in proc.info["cmdline"] or ()):
                try:
                    proc.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
        shutil.rmtree(root, ignore_errors=True)


def test_joining_a_cluster_without_token_auth_warns_once(open_head, monkeypatch, caplog):
    from torchrl_oni.train import distributed

    assert distributed.cluster_requires_auth(open_head) is False  # it answers a client without a token

    class Stop(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(distributed, "RayEnvCollector", refuse)  # the check only: no actors
    with caplog.at_level(logging.WARNING, logger="torchrl_oni.train"):
        for _ in range(2):
            with pytest.raises(Stop):
                make_collector("ray", [], torch.nn.Linear(1, 1), frames_per_batch=8, total_frames=8,
                               ray_address=open_head)
    said = [r.getMessage() for r in caplog.records if "without a token" in r.getMessage()]
    assert len(said) == 1 and "RAY_AUTH_MODE=token" in said[0] and "RAY_AUTH_TOKEN" in said[0], said
    assert not ray.is_initialized()


def _deterministic(actor, action: int):
    """A copy of ``actor`` whose logits are +50 on ``action`` and 0 elsewhere, whatever the input."""
    actor = copy.deepcopy(actor)
    last = [m for m in actor.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
        last.bias[action] = 50.0
    return actor


@pytest.mark.slow
def test_weights_reach_every_actor_on_a_local_ray_instance():
    """Weights pushed mid-run reach every actor: at most one batch per worker (the one already
    requested) is played with the old ones. Without an address a Ray instance is started for the
    run and stopped by shutdown()."""
    assert not ray.is_initialized()
    cfg = TrainConfig(workers=2, envs_per_worker=4, rollout=16)
    actor, _ = make_actor_critic(NLEBatchEnv("score", num_envs=1, seed=0))
    collector = make_collector("ray", [make_env_factory(cfg, w) for w in range(2)], actor,
                               frames_per_batch=64, total_frames=64 * 200)
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 2  # sized for its actors
    seen = []  # (phase, worker, set of actions)
    phase = 0

    def delivered(worker):
        return sum(1 for p, w, _ in seen if p == phase and w == worker)

    try:
        for batch in collector:
            assert batch.shape == (4, 16)
            seen.append((phase, collector.last_worker, set(batch["action"].unique().tolist())))
            if min(delivered(0), delivered(1)) < 3:
                continue
            if phase == 0:  # explicit weights
                collector.update_policy_weights_(TensorDict.from_module(_deterministic(actor, 5)))
            elif phase == 1:  # no weights: read from the policy given to make_collector, changed in place
                TensorDict.from_module(_deterministic(actor, 7)).to_module(actor)
                collector.update_policy_weights_()
            else:
                break
            phase += 1
    finally:
        collector.shutdown()
    assert phase == 2, seen
    assert not ray.is_initialized()
    assert all(len(actions) > 3 for p, _, actions in seen if p == 0)  # initial policy: near uniform
    for phase, action in ((1, {5}), (2, {7})):
        for worker in (0, 1):
            after = [actions for p, w, actions in seen if p == phase and w == worker]
            assert all(actions == action for actions in after[1:]), (phase, worker, after)


@pytest.fixture(scope="module")
def cluster():
    """A head node without CPUs for actors (the learner's) and two one-CPU worker nodes."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    fast_failure_detection = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                              "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=False, object_store_memory=100 * MB, _system_config=fast_failure_detection))
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=100 * MB)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def _config(tmp_path, cluster, **kw):
    """The tiny run on the cluster's two worker nodes, the whole batch one minibatch (the default 1024)."""
    return tiny_config(tmp_path, **{"frames": 2048, "workers": 2, "minibatch_size": 1024, "checkpoint_every": 100_000,
                                    "backend": "ray", "ray_address": cluster.address, **kw})


class _Record(TrainHook):
    """Counts the frames the trainer receives and which worker produced each batch."""

    stages = ("batch",)

    def __init__(self):
        self.frames, self.workers = 0, []

    def on_batch(self, batch, trainer):
        self.frames += batch.numel()
        self.workers.append(trainer.workers.collector.last_worker)
        return batch


@pytest.mark.slow
def test_train_across_two_nodes_then_resume(cluster, tmp_path):
    record = _Record()
    trainer = Trainer.from_config(_config(tmp_path, cluster), hooks=[record])
    summary = trainer.train()
    nodes = {node for node, _ in trainer.workers.collector.worker_nodes}
    assert nodes == {n.node_id for n in cluster.worker_nodes}  # one actor on each worker node
    assert summary["frames"] == 2048 == record.frames and trainer.iterations == 16
    assert set(record.workers) == {0, 1}
    assert not ray.is_initialized()  # the run's connection to the cluster is closed at the end

    resumed = Trainer.from_config(_config(tmp_path, cluster, frames=3072, resume="auto"), hooks=[_Record()])
    assert resumed.frames == 2048 and resumed.iterations == 16
    summary = resumed.train()
    assert summary["frames"] == 3072 and resumed.iterations == 24
    assert resumed.hooks[0].frames == 1024


@pytest.mark.slow
def test_training_survives_a_dead_actor_and_a_dead_node(cluster, tmp_path, caplog):
    """Worker 0's process is killed (Ray restarts it), then worker 1's node dies (its actor
    cannot be placed again): training finishes on what is left, counts every frame once, and
    says so once per incident."""

    class Faults(_Record):
        stages = ("batch", "post_update")

        def after_update(self, trainer):
            collector = trainer.workers.collector
            if trainer.iterations == 3:
                ray.kill(collector.remote_collectors[0], no_restart=False)  # a crash: Ray restarts it
            if trainer.iterations == 4:  # let the restart happen before the node goes
                # a restart imports torch and builds the games again: minutes on a starved CPU
                deadline, start = time.monotonic() + 300, time.monotonic()
                while True:
                    try:
                        ray.get(collector.remote_collectors[0].node.remote(), timeout=10)
                        print(f"worker 0 restarted in {time.monotonic() - start:.0f} s")
                        break
                    except ray.exceptions.RayError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
            if trainer.iterations == 10:
                node_id = collector.worker_nodes[1][0]
                cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_id),
                                    allow_graceful=False)
            if trainer.iterations >= 10:
                # Ray learns of the death by health checks (seconds under load); worker 0 alone can
                # finish the run before that, and then nobody is told. Hold the learner until worker
                # 1's outstanding request is settled: failed (the collector reports it next), or
                # delivered just before the node went (the collector asks again, and the request
                # after this update is the one that fails).
                deadline = time.monotonic() + 60
                while 1 not in collector._down and 1 not in collector._dropped:
                    request = [f for f, (idx, _) in list(collector._pending.items()) if idx == 1]
                    if not request or request[0].done():
                        break
                    assert time.monotonic() < deadline, "Ray never reported worker 1's node dead"
                    time.sleep(0.1)

    faults = Faults()
    caplog.set_level(logging.WARNING, logger="torchrl_oni.train")
    try:
        summary = Trainer.from_config(_config(tmp_path, cluster, frames=4096), hooks=[faults]).train()
    finally:
        if len(cluster.worker_nodes) < 2:
            cluster.add_node(num_cpus=1, object_store_memory=100 * MB)
    assert summary["frames"] == 4096 == faults.frames
    assert len(faults.workers) == 32
    assert 0 in faults.workers[4:]  # the restarted worker delivered again
    assert set(faults.workers[12:]) == {0}  # after its node died, worker 1 delivered nothing
    lines = [r.getMessage() for r in caplog.records if r.name == "torchrl_oni.train"]
    assert sum("env worker 0" in line and "died" in line for line in lines) == 1, lines
    assert sum("env worker 1" in line and "died" in line for line in lines) == 1, lines
    assert sum("env worker 0" in line and "is back" in line for line in lines) == 1, lines
