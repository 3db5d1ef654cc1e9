"""``--compile``: the learner's update through ``torch.compile`` computes what the eager update
computes — advantages, statistics and weights, update after update, on batches whose episode ends
differ (the padded shapes) — on the light policy's two paths (one minibatch of the whole batch,
several minibatches) and the GRU policy's; and a run trains with it."""
import copy

import pytest
import torch

from torchrl_oni.train.config import PPOConfig, TrainConfig, _has_cxx
from torchrl_oni.train.learner import PPOLearner, feedforward_values, rollout_batch


def _batches(arch):
    """Networks and three batches [6, 24] with different episode ends (hence different counts of
    next observations to value)."""
    actor, critic, first = rollout_batch(arch, 6, 24, 10, 0)
    second = rollout_batch(arch, 6, 24, 7, 1)[2]
    return actor, critic, [first, second, first]


def _compare_compiled(arch, minibatch, backend, mode="default", updates=3):
    actor, critic, batches = _batches(arch)
    recurrent = arch != "light"
    eager = PPOLearner(*copy.deepcopy((actor, critic)), PPOConfig(minibatch_size=minibatch, lr=1e-3),
                       torch.device("cpu"), recurrent=recurrent)
    compiled = PPOLearner(*copy.deepcopy((actor, critic)), PPOConfig(minibatch_size=minibatch, lr=1e-3, compile=mode),
                          torch.device("cpu"), recurrent=recurrent, compile_backend=backend)
    assert compiled.run_actor_loss is not compiled.actor_loss or compiled.actor_loss is None
    for batch in batches[:updates]:
        a, b = batch.clone(), batch.clone()
        torch.manual_seed(0)
        stats_eager = eager.update(a)
        torch.manual_seed(0)
        stats_compiled = compiled.update(b)
        torch.testing.assert_close(b["advantage"], a["advantage"], rtol=1e-4, atol=1e-5)
        assert stats_compiled.keys() == stats_eager.keys()
        for key, value in stats_eager.items():
            assert stats_compiled[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
        for p, q in zip(eager.params, compiled.params):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    return eager, compiled, batches


def test_padded_next_observations_give_the_same_values():
    """The compiled critic sees the next observations padded to whole rows of games: the values
    written are those of the unpadded pass."""
    actor, critic, batches = _batches("light")
    for batch in batches[:2]:
        plain, padded = batch.clone(), batch.clone()
        with torch.no_grad():
            feedforward_values(critic, plain, ["state_value"])
            feedforward_values(critic, padded, ["state_value"], pad_multiple=5)
        for key in ("state_value", ("next", "state_value")):
            torch.testing.assert_close(padded[key], plain[key])
    rows = []
    critic.register_forward_hook(lambda module, inputs, output: rows.append(output.shape[0]))
    need = batches[1].get(("next", "done")).squeeze(-1).clone()
    need[:, -1] = True
    with torch.no_grad():
        feedforward_values(critic, batches[1].clone(), ["state_value"], pad_multiple=5)
    assert rows == [144 + -(-int(need.sum()) // 5) * 5] and int(need.sum()) % 5, "this batch is padded"


@pytest.mark.parametrize("arch,minibatch", [("light", 144), ("light", 48), ("oni", 144)],
                         ids=["light-whole-batch", "light-minibatches", "gru-whole-batch"])
def test_compiled_update_equals_eager_update(arch, minibatch):
    """Dynamo's graphs with autograd (``aot_eager``: no generated code), three updates."""
    eager, compiled, batches = _compare_compiled(arch, minibatch, "aot_eager")
    assert compiled.reuses_critic_pass(batches[0]) is (minibatch == 144)
    if arch == "light":
        assert compiled.run_loss is not compiled.loss and compiled.run_critic is not compiled.critic
    else:  # the GRU's recurrent pass stays eager; its heads are compiled
        assert compiled.run_loss is compiled.loss and compiled.run_critic_head is not compiled.loss_critic


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="inductor on the CPU needs a C++ compiler")
def test_inductor_compiled_update_equals_eager_update():
    """The real thing (generated kernels), on the CPU defaults' path: one minibatch of the whole
    batch, two shapes of next observations."""
    _compare_compiled("light", 144, "inductor", updates=2)


def test_compile_off_runs_the_modules_themselves():
    actor, critic, batches = _batches("light")
    learner = PPOLearner(actor, critic, PPOConfig(minibatch_size=144), torch.device("cpu"))
    assert learner.compile_mode == "off"
    assert (learner.run_loss, learner.run_actor_loss, learner.run_critic) == (learner.loss, learner.actor_loss, critic)
    with pytest.raises(ValueError, match="compile"):
        TrainConfig(compile="fast").validate()


def test_a_run_trains_with_compile(tmp_path, monkeypatch):
    """``--compile default`` from the configuration to the learner: a short run updates through
    the compiled loss and critic (dynamo's graphs; the backend made ``aot_eager`` to keep the
    test short: the generated kernels are tested above)."""
    from torchrl_oni.train.ppo import Trainer
    from torchrl_oni.train.run_log import read_metrics

    original = torch.compile
    backends = []

    def compile_without_codegen(module, backend="inductor", **options):
        backends.append((backend, options))
        return original(module, backend="aot_eager", **options)

    monkeypatch.setattr(torch, "compile", compile_without_codegen)
    cfg = TrainConfig(frames=3 * 128, workers=1, envs_per_worker=4, rollout=32, compile="default",
                      logdir=str(tmp_path), progress=False, tensorboard=False)
    trainer = Trainer.from_config(cfg)
    calls = []
    trainer.learner.run_actor_loss.register_forward_hook(lambda *args: calls.append(1))
    summary = trainer.train()
    assert summary["frames"] == 384 and read_metrics(str(tmp_path))[-1]["iteration"] == 3
    assert backends == [("inductor", {})] * 3, "the actor's loss, the whole loss and the critic"
    assert len(calls) == 3, "every update went through the compiled loss"
    assert "compile: default" in (tmp_path / "config.yaml").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_compiled_update_equals_eager_update(mode):
    """On the GPU, through Triton kernels and (``reduce-overhead``) CUDA graphs, from CPU batches
    as the trainer hands them over: the eager CUDA update's advantages, statistics and weights."""
    actor, critic, batches = _batches("light")
    cuda = torch.device("cuda")
    ppo = dict(minibatch_size=144, lr=1e-3)
    eager = PPOLearner(*[m.to(cuda) for m in copy.deepcopy((actor, critic))], PPOConfig(**ppo), cuda)
    compiled = PPOLearner(*[m.to(cuda) for m in copy.deepcopy((actor, critic))], PPOConfig(**ppo, compile=mode), cuda)
    for batch in batches:
        torch.manual_seed(0)
        stats_eager = eager.update(batch.clone())
        torch.manual_seed(0)
        stats_compiled = compiled.update(batch.clone())
        for key, value in stats_eager.items():
            assert stats_compiled[key] == pytest.approx(value, rel=2e-3, abs=1e-4), key
        for p, q in zip(eager.params, compiled.params):
            torch.testing.assert_close(q, p, rtol=1e-3, atol=4e-3)
